"""Host memory registered with CUDA as pinned (cudaHostRegister), so copies
between it and the device are DMA: the cache's arena, mapped by this process.

Registrations are process-wide and counted. A range can be registered once:
a second cudaHostRegister of it fails (cudaErrorHostMemoryAlreadyRegistered),
and every runner of a process maps the same arena (the benchmarks build one
per model shape). And a failed CUDA runtime call is not only returned: CUDA
keeps it as the thread's last error, which the next kernel launch on that
thread (torch checks every launch) would raise as its own. So a failure is
cleared at once; copies then still work, staged through pageable memory.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstash.cache_sdk.shared_arena import buffer_address

log = logging.getLogger(__name__)

_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
Key = tuple[int, int]  # a registered range: (address, bytes)


@dataclass(slots=True)
class PinnedRegions:
    register: Callable[[int, int], int]  # (address, bytes) -> CUDA error code, 0 = success
    unregister: Callable[[int], int]
    clear_error: Callable[[], None]
    _counts: dict[Key, int] = field(default_factory=dict)
    _refused: set[Key] = field(default_factory=set)  # not asked again

    def acquire(self, region: object) -> Key | None:
        """Registers `region` (a writable buffer) unless already registered;
        returns the key to release it by, or None if CUDA refused it (then,
        and later, it is not counted)."""
        key = (buffer_address(region), memoryview(region).nbytes)  # type: ignore[arg-type]
        if key in self._counts:
            self._counts[key] += 1
            return key
        if key in self._refused:
            return None
        error = self.register(*key)
        if error:
            self.clear_error()
            self._refused.add(key)
            log.warning("pinning %d bytes of host memory failed (CUDA error %d); KV copies "
                        "to the cache's arena will be staged through pageable memory",
                        key[1], error)
            return None
        self._counts[key] = 1
        return key

    def release(self, key: Key) -> None:
        """Drops one `acquire` (by its key: the region may be unmapped by
        now); the last unregisters the range."""
        count = self._counts.get(key, 0)
        if count > 1:
            self._counts[key] = count - 1
        elif count == 1:
            del self._counts[key]
            if self.unregister(key[0]):
                self.clear_error()


@functools.cache
def cuda_regions() -> PinnedRegions:
    """The process's registry, through torch's CUDA runtime bindings."""
    cudart = torch.cuda.cudart()
    return PinnedRegions(
        register=lambda address, size: int(cudart.cudaHostRegister(address, size, 0)),
        unregister=lambda address: int(cudart.cudaHostUnregister(address)),
        clear_error=_clear_cuda_error,
    )


def _clear_cuda_error() -> None:
    """cudaGetLastError on this thread, through the runtime torch loaded
    (torch's bindings do not offer it)."""
    for name in _CUDART_NAMES:
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        runtime.cudaGetLastError()
        return
    log.warning("could not clear the CUDA error: no loaded libcudart among %s", _CUDART_NAMES)
