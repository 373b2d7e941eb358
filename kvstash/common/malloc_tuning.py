"""glibc malloc settings for processes that stream KV snapshots, and for a
worker that computes on the CPU.

Call `tune_malloc()` once at start-up, before any traffic, in every process
that moves snapshot bytes (the cache service, the worker) and in the benchmarks;
a worker on the CPU then also calls `keep_large_tensors()`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

from kvstash.common.units import MIB

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 16 * MIB
TRIM_THRESHOLD_BYTES = 64 * MIB
ARENA_MAX = 2
KEEP_BYTES = 1024 * MIB  # keep_large_tensors' thresholds


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def tune_malloc() -> bool:
    """Makes chunk-sized buffers be recycled instead of mmap'd and munmap'd per copy.

    Every snapshot chunk passes through a few 1-4 MiB buffers (gRPC's
    received bytes, the encoded message, gRPC's slices), allocated and freed
    at a high rate, some in gRPC's threads. With glibc's defaults each is a
    fresh mmap whose pages are faulted in, zeroed and unmapped again per
    chunk, or comes from per-thread heaps that are trimmed and regrown; both
    cost more than gRPC itself (a 256 MiB transfer spent most of its time in
    the kernel, and a bare gRPC stream moved bytes at half the speed). So:
      - mmap threshold 16 MiB, above the largest chunk message (4 MiB + framing);
      - trim threshold 64 MiB: free memory at the top of a heap beyond that
        goes back to the OS, so an idle process does not keep a burst's buffers;
      - two arenas, so gRPC's threads cannot spread chunks over many heaps.
    The heap never holds more than the chunk copies that were once live at
    the same time, which the cache's documented overhead already bounds.

    Returns False (and changes nothing) where glibc's mallopt is missing;
    logs a warning if mallopt refuses a setting.
    """
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    ok = (
        bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
        and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
        and bool(mallopt(_M_ARENA_MAX, ARENA_MAX))
    )
    if not ok:
        log.warning("mallopt refused; resident memory may exceed the documented bound")
    return ok


def keep_large_tensors() -> bool:
    """Raises both thresholds to KEEP_BYTES, for a worker computing on the CPU.

    A CPU step allocates the same large temporaries layer after layer and step
    after step (a 4 x 1,024-token prefill's attention scores are 38 MB a
    layer): above the mmap threshold each is a fresh mapping whose every page
    faults in again, a third of that prefill's time. Kept in the heap, the
    next layer reuses them, as PyTorch's CPU tuning guide gets from preloading
    jemalloc or tcmalloc. The cost: up to KEEP_BYTES of freed memory stays
    mapped in the worker. Returns False where mallopt is missing or refused."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
    if not ok:
        log.warning("mallopt refused %d-byte thresholds", KEEP_BYTES)
    return ok


def trim_heap() -> None:
    """Hands malloc's free memory back to the OS (glibc's `malloc_trim`).

    Once a burst's chunk buffers are freed, glibc returns only the free top of
    each heap by itself and keeps the holes below live blocks resident. The
    cache's sweeper calls this every sweep. No-op without glibc."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
