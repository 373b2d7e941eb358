"""Hypothesis settings for the scheduler core's property tests, and the
engine tests' services (engine_services.py).

Registered as a named profile, not loaded globally: the property tests apply
it with `@settings(parent=settings.get_profile(PROFILE))`, so other test
folders keep their own settings. Example counts keep this folder under ~60 s
on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvstash.launch.processes import Service
from tests.scheduler_svc.engine_services import start_services

PROFILE = "scheduler_svc"

settings.register_profile(
    PROFILE,
    max_examples=300,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Service]]:
    cache, worker = start_services(tmp_path_factory.mktemp("engine-logs"))
    yield cache, worker
    worker.stop()
    cache.stop()


@pytest.fixture
def own_services(tmp_path: Path) -> Iterator[tuple[Service, Service]]:
    """A pair for a test that kills one of them."""
    cache, worker = start_services(tmp_path)
    yield cache, worker
    worker.stop()
    cache.stop()
