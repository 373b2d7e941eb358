"""Registering the cache's arena as pinned memory, process-wide: once per
range however many runners map it, unregistered with the last, and a refusal
cleared at once (CUDA would raise it again at the next kernel launch). The
CUDA calls are recorded here; `make test-gpu` makes them for real."""

from __future__ import annotations

import mmap

from gpu_worker.host_pinning import PinnedRegions
from kvstash.cache_sdk.shared_arena import buffer_address


class Recorder:
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.calls: list[tuple[str, int]] = []

    def regions(self) -> PinnedRegions:
        def register(address: int, size: int) -> int:
            self.calls.append(("register", address))
            return 712 if self.refuse else 0

        def unregister(address: int) -> int:
            self.calls.append(("unregister", address))
            return 0

        return PinnedRegions(register, unregister,
                             lambda: self.calls.append(("clear", 0)))


def test_a_range_is_registered_once_and_unregistered_with_its_last_user() -> None:
    recorder = Recorder()
    regions = recorder.regions()
    arena = mmap.mmap(-1, 1 << 20)
    address = buffer_address(arena)
    first, second = regions.acquire(arena), regions.acquire(arena)  # two runners
    assert first == second == (address, 1 << 20)
    assert recorder.calls == [("register", address)]
    regions.release(first)
    assert recorder.calls == [("register", address)]
    arena.close()  # released by key: the mapping may be gone by then
    regions.release(second)
    assert recorder.calls == [("register", address), ("unregister", address)]


def test_a_refused_range_is_cleared_at_once_and_not_asked_again() -> None:
    recorder = Recorder(refuse=True)
    regions = recorder.regions()
    region = bytearray(4096)
    assert regions.acquire(region) is None
    assert regions.acquire(region) is None
    assert recorder.calls == [("register", buffer_address(region)), ("clear", 0)]
