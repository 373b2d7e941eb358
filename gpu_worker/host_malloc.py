"""glibc's malloc kept from giving a step's large tensors back to the kernel.

A step on the CPU allocates the same large temporaries layer after layer and
step after step (a 4 x 1,024-token prefill's attention scores are 38 MB a
layer). glibc serves a block above its mmap threshold (which adapts, up to
32 MiB) with a fresh mmap and unmaps it when freed, so each such tensor
faults in every one of its pages again: measured, a third of that prefill's
time. With both thresholds raised, freed blocks stay in the heap for the next
layer, which is what PyTorch's CPU tuning guide gets from preloading jemalloc
or tcmalloc, here without a library to preload. The cost: up to
`KEEP_BYTES` of freed memory stays mapped in the worker.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

KEEP_BYTES = 1 << 30
_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3


def keep_large_blocks(keep_bytes: int = KEEP_BYTES) -> bool:
    """Blocks up to `keep_bytes` come from the heap, and up to `keep_bytes`
    freed at its top stay there. False where the C library is not glibc (no
    `mallopt`) or refused; nothing changes then."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        log.info("no mallopt in the C library: large tensors are mapped afresh each time")
        return False
    done = all(mallopt(option, keep_bytes) == 1
               for option in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD))
    if not done:
        log.warning("mallopt refused %d-byte thresholds", keep_bytes)
    return done
