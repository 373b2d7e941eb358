"""A real worker and a real, deliberately slow cache service for the engine's
tests, which run the scheduler core in their own event loop (the fixtures
are in conftest.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.launch.processes import Service, start_service
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine import Engine
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.streams import RequestStream

NUM_BLOCKS = 16
# 1 MiB/s: a snapshot of a few 64 KiB blocks takes a good fraction of a second.
SLOW_CACHE = ("--memory-budget", "256MiB", "--bandwidth-limit", "1MiB")


def start_services(logs: Path, cache_flags: Sequence[str] = SLOW_CACHE
                   ) -> tuple[Service, Service]:
    cache = start_service("cache", "cache_svc", ["--listen", "127.0.0.1:0", *cache_flags], logs)
    try:
        worker = start_service("worker", "gpu_worker", [
            "--listen", "127.0.0.1:0", "--dtype", "float64", "--num-blocks", str(NUM_BLOCKS),
            "--cache-address", cache.address,
        ], logs)
    except BaseException:
        cache.stop()
        raise
    return cache, worker


@dataclass(slots=True)
class Harness:
    engine: Engine
    core: Scheduler
    cache: CacheClient
    metrics: SchedulerMetrics | None = None


async def collect(stream: RequestStream) -> tuple[list[int], RequestStatus]:
    tokens: list[int] = []
    while True:
        event = await stream.events.get()
        assert not isinstance(event, Exception), event
        tokens.extend(event.new_token_ids)
        if event.finish_status is not None:
            return tokens, event.finish_status


