"""Fixtures shared by every test folder: real service processes on free ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstash.launch.stack import Stack, StackConfig, running_stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One unpressured stack (cache, worker, scheduler as real processes)."""
    with running_stack(StackConfig(num_blocks=256), tmp_path_factory.mktemp("stack-logs")) as s:
        yield s
