"""The memory tier: its buffers and its accounting.

`Tiers` moves bytes between the figures as snapshots are reserved, listed
and freed; this module keeps where buffers come from and go back to, and
the invariant (see `check_integrity`):

    used + reserved + pool.num_bytes + unmapping + quarantined  <=  memory budget

`reserved` counts buffers of puts in progress (they are preallocated, so
counted); freed buffers pooled for reuse count too, and yield to any put
that needs the room; so do buffers being unmapped, until they are gone, and
arena extents in quarantine, until it ends (`give_back`).

Buffers are private mappings, or, with an arena (cache_svc.arena), extents of
it; there the arena, sized to the budget, decides what fits (a put may also
have to wait for a contiguous range), and freed extents are its free ranges,
so the buffer pool stays empty.
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Callable

from cache_svc.arena import Arena
from cache_svc.background import Background
from cache_svc.buffers import BufferPool, close_now
from cache_svc.config import CacheConfig
from cache_svc.eviction import ArenaRoom, BytesRoom, Room
from cache_svc.model import Buffer, pages


class MemoryTier:
    def __init__(self, config: CacheConfig, clock: Callable[[], float],
                 background: Background) -> None:
        self.budget = config.memory_budget_bytes
        self._clock = clock
        self._background = background
        self.used = 0  # bytes of listed entries' buffers, and of those readers still hold
        self.reserved = 0  # bytes of puts in progress
        self.arena = Arena(config.arena_dir, self.budget) if config.arena_dir else None
        self.pool = BufferPool(0 if self.arena else config.buffer_pool_bytes,
                               unmap=self._unmap_soon)
        # Bytes of buffers let go of but not yet unmapped: still resident, so
        # not free, but soon (see `_unmap_soon`).
        self.unmapping = 0
        # Bytes of arena extents kept from reuse for a while (`_quarantine`),
        # and the timers that end their quarantines.
        self.quarantined = 0
        self._quarantine_ends: set[asyncio.TimerHandle] = set()

    def free(self) -> int:
        """Budget bytes a put can reserve: pooled buffers count as free,
        those being unmapped or quarantined do not yet."""
        return self.budget - self.used - self.reserved - self.unmapping - self.quarantined

    def room_for(self, size: int) -> Room:
        """The room a put of `size` bytes needs, as it stands. In an arena room
        must be one range, so only victims that make one long enough count."""
        if self.arena is not None:
            return ArenaRoom(self.arena.runs(), size)
        return BytesRoom(self.free() + self.unmapping, size)

    def give_back(self, buffer: Buffer, quarantine_s: float = 0.0) -> None:
        """A buffer nobody uses any more: an extent back to the arena (after
        `quarantine_s`, if given: see `_quarantine`), a mapping to the pool
        (still counted there)."""
        if isinstance(buffer, mmap.mmap):
            self.pool.give(buffer, self._clock())
        elif quarantine_s > 0:
            self._quarantine(buffer, quarantine_s)
        else:
            assert self.arena is not None
            self.arena.free(buffer)

    def _quarantine(self, extent: memoryview, seconds: float) -> None:
        """Frees an extent only `seconds` from now, counting its bytes
        meanwhile: a client cut off while writing it may still be copying, and
        must not write into the bytes of whoever gets the extent next."""
        arena = self.arena
        assert arena is not None
        size = pages(extent.nbytes)
        self.quarantined += size

        def end() -> None:
            self._quarantine_ends.discard(handle)
            self.quarantined -= size
            arena.free(extent)
            self._background.notify()

        handle = asyncio.get_running_loop().call_later(seconds, end)
        self._quarantine_ends.add(handle)

    def _unmap_soon(self, buffer: mmap.mmap) -> None:
        """Unmaps a buffer on another thread: that takes ~70 ms per GiB, which
        every other call would otherwise wait out. Its bytes stay counted
        until it is gone, so resident memory never exceeds the budget."""
        size = pages(len(buffer))
        self.unmapping += size

        async def unmap() -> None:
            try:
                await asyncio.to_thread(close_now, buffer)
            finally:
                self.unmapping -= size
                self._background.notify()

        self._background.spawn(unmap())

    def trim_pool(self, idle_s: float) -> None:
        """Unmaps pooled buffers nobody reused for `idle_s` seconds."""
        self.pool.release_idle(self._clock() - idle_s)

    def close(self) -> None:
        """Removes the arena, quarantine or not: nobody gets an extent any more."""
        for handle in self._quarantine_ends:
            handle.cancel()
        if self.arena is not None:
            self.arena.close()

    def check_integrity(self, listed_bytes: int) -> None:
        """Raises AssertionError when the accounting disagrees with the
        buffers; `listed_bytes`: those of listed entries in memory (lingering
        entries held only by readers are not counted)."""
        assert self.used >= listed_bytes, (self.used, listed_bytes)
        assert (self.used + self.reserved + self.pool.num_bytes + self.unmapping
                + self.quarantined <= self.budget)
        self.pool.check_integrity()
        if self.arena is not None:
            self.arena.check_integrity(self.used + self.reserved + self.quarantined)
        assert self.reserved >= 0
        assert self.quarantined >= 0
