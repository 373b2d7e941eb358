"""Keeps glibc from page-faulting and hoarding chunk buffers.

Every chunk passes through a few 1-4 MiB buffers (gRPC's receive bytes, the
encoded message, gRPC's slices), allocated and freed at a high rate, some in
gRPC's threads. glibc's defaults handle that badly both ways: below its mmap
threshold they come from per-thread heaps that are trimmed and regrown, above
it (the old fixed 256 KiB setting here) each is a fresh mmap whose pages are
faulted in, zeroed and unmapped again per chunk, which cost more than
gRPC itself (a 256 MiB put spent most of its time in the kernel).

So chunk-sized blocks come from the heap and are recycled:
  - mmap threshold 16 MiB, above the largest chunk message (4 MiB + framing);
  - trim threshold 64 MiB: free memory at the top of a heap beyond that goes
    back to the OS, so an idle server does not keep a burst's buffers;
  - two arenas, so gRPC's threads cannot spread chunks over many heaps.
The heap never holds more than the chunk copies that were once live at the
same time, which CacheConfig's documented overhead already bounds (peak RSS
is unchanged; steady-state RSS keeps at most the trim threshold of it).
Snapshot buffers are separate anonymous mmaps (ingest.allocate) and return to
the OS when dropped. No-op where glibc's mallopt is missing.

Processes that stream snapshots through CacheClient (the worker, the
benchmark) benefit from the same call at start-up.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 16 << 20
TRIM_THRESHOLD_BYTES = 64 << 20


def tune_malloc() -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    ok = (
        bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
        and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
        and bool(mallopt(_M_ARENA_MAX, 2))
    )
    if not ok:
        log.warning("mallopt refused; resident memory may exceed the documented bound")
    return ok
