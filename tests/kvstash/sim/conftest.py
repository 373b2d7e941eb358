"""The simulator's tests run `kvstash sim` against their own mypyc cache,
never the user's (~/.cache/kvstash): `--core auto` finds only what a test built."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.gpu_worker.worker_factories import REPO


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cache = str(tmp_path_factory.mktemp("kvstash-cache"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSTASH_CACHE_DIR", cache)
        yield cache


@pytest.fixture(scope="session")
def compiled_core(own_cache: str) -> str:
    """The scheduler core compiled by mypyc into the tests' cache (once: ~40 s
    on 2 cores); `kvstash sim --core auto` finds it from then on."""
    done = subprocess.run(
        [sys.executable, "-c", "from kvstash.sim import compiled; compiled.activate('compiled')"],
        cwd=REPO, env=os.environ, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return own_cache
