"""Keeps glibc from hoarding freed chunk buffers.

Chunks are 1-4 MiB `bytes` objects allocated and freed at a high rate, some in
I/O threads. By default glibc raises its mmap threshold after such frees and
then serves them from per-thread heaps that are rarely given back, so resident
memory creeps far past what is live. A fixed threshold keeps every chunk-sized
allocation an mmap that returns to the OS when freed, and two arenas cap the
per-thread heaps. No-op where glibc's mallopt is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc malloc.h
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 256 << 10


def tune_malloc() -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_ARENA_MAX, 2))
    if not ok:
        log.warning("mallopt refused; resident memory may exceed the documented bound")
    return ok
