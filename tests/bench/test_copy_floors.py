"""The floors benchmarks measure our copies against run as fast as they can."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest

from bench import arena_bench, cache_bench
from kvstash.cache_sdk.shared_arena import COPY_THREADS
from kvstash.common.units import MIB


@pytest.mark.parametrize("chunk_bytes", [MIB, 2 * MIB])
def test_the_raw_socket_get_sends_its_chunks_without_copying_them(chunk_bytes: int) -> None:
    """Slicing the payload (bytes) copied each chunk first, but for 4 MiB ones:
    the baseline of cache_bench's get ratios was slowest where it counts."""
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=cache_bench._raw_server, args=(listener,), daemon=True).start()
    port = listener.getsockname()[1]
    data = np.random.default_rng(0).integers(0, 256, 8 * MIB, dtype=np.uint8)
    out = np.zeros_like(data)
    cache_bench.raw_socket_round(port, data.data, out.data, chunk_bytes)  # buffers made
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        cache_bench.raw_socket_round(port, data.data, out.data, chunk_bytes)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert peak < chunk_bytes // 2


@pytest.mark.skipif(COPY_THREADS < 2, reason="one usable CPU: one copy thread either way")
def test_the_memcpy_floor_copies_on_as_many_threads_as_the_arena_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread's memcpy against a copy spread over every core flattered
    the arena path."""
    threads: set[int] = set()
    real = arena_bench.copy_bytes

    def copy(dst: memoryview, src: memoryview) -> None:
        threads.add(threading.get_ident())
        time.sleep(0.02)  # long enough for the pool to fan out
        real(dst, src)

    monkeypatch.setattr(arena_bench, "copy_bytes", copy)
    data = np.random.default_rng(1).integers(0, 256, 8 * MIB, dtype=np.uint8)
    scratch, out = np.zeros_like(data), np.zeros_like(data)
    arena_bench.memcpy_round(data, scratch, out)
    assert np.array_equal(out, data) and len(threads) == COPY_THREADS
