"""The two tiers and their accounting: where each listed snapshot's bytes live,
what that costs, and making memory room by spilling or evicting.

Mechanism only; `SnapshotStore` decides what to list, read and drop. Plain
asyncio and no gRPC: bookkeeping happens on the event loop, disk work in a
thread pool. Accounting invariants (see `check_integrity`):

    memory_used + reserved       <= memory budget   (buffers of puts in progress
      + pool.num_bytes                               are preallocated, so counted;
                                                     so are freed buffers pooled
                                                     for reuse, which yield to
                                                     any put that needs the room)
    disk_used + disk_reserved    <= disk budget     (disk_reserved: spills running)

Memory buffers are private mappings, or, with an arena (cache_svc.arena),
extents of it; there the arena, sized to the budget, decides what fits (a
put may also have to wait for a contiguous range), and freed extents are its
free ranges, so the buffer pool stays empty.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import mmap
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cache_svc.arena import Arena, FreeRuns
from cache_svc.buffers import BufferPool, close_now
from cache_svc.config import CacheConfig
from cache_svc.disk import DiskFiles
from cache_svc.eviction import Room, plan_room
from cache_svc.model import Buffer, Entry, Residence
from kvstash.errors import NotFound, ResourceExhausted, preview

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _BytesRoom:
    free: int
    size: int

    def enough(self) -> bool:
        return self.free >= self.size

    def add(self, victim: Entry) -> None:
        self.free += victim.size


@dataclass(slots=True)
class _ArenaRoom:
    runs: FreeRuns
    size: int

    def enough(self) -> bool:
        return self.runs.longest >= self.size

    def add(self, victim: Entry) -> None:
        assert isinstance(victim.buffer, memoryview)  # in an arena, every buffer is
        self.runs.free(victim.buffer)


class Tiers:
    def __init__(self, config: CacheConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.disk = (
            DiskFiles(config.disk_dir, config.disk_write_bytes_per_s) if config.disk_dir else None
        )
        self._io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="cache-io")
        # Listed snapshots, least recently used first.
        self._lru: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self.memory_used = 0
        self.reserved = 0
        self.disk_used = 0
        self.disk_reserved = 0
        self.arena = (
            Arena(config.arena_dir, config.memory_budget_bytes) if config.arena_dir else None
        )
        self.pool = BufferPool(0 if self.arena else config.buffer_pool_bytes,
                               unmap=self._unmap_soon)
        # Bytes of buffers let go of but not yet unmapped: still resident, so
        # not free, but soon (see `_unmap_soon`).
        self.unmapping = 0
        self.num_evictions = 0
        self.num_spills = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed = asyncio.Event()

    async def recover(self) -> None:
        """Lists the disk tier's snapshots again after a restart."""
        if self.disk is None:
            return
        found = await self.run_io(self.disk.scan)
        now = self.clock()
        for snap in found:  # oldest first, so LRU order survives a restart
            entry = Entry(snap.meta, Residence.DISK, now, snap.checksums, path=snap.path)
            self._lru[snap.meta.snapshot_id] = entry
            self.disk_used += entry.size
        if found:
            log.info("disk tier: recovered %d snapshots, %d bytes", len(found), self.disk_used)

    async def close(self) -> None:
        """Lets running spills, unlinks and unmaps finish, then stops the I/O
        threads."""
        self.pool.release(self.pool.num_bytes)
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._io.shutdown(wait=True)
        if self.arena is not None:
            self.arena.close()

    # -- listing --------------------------------------------------------------

    def entries(self) -> Iterable[Entry]:
        """Listed entries, least recently used first."""
        return self._lru.values()

    def is_listed(self, snapshot_id: str) -> bool:
        return snapshot_id in self._lru

    def lookup(self, snapshot_id: str) -> Entry:
        entry = self._lru.get(snapshot_id)
        if entry is None:
            raise NotFound(f"snapshot {preview(snapshot_id)} not found")
        return entry

    def touch(self, entry: Entry) -> None:
        entry.last_access = self.clock()
        self._lru.move_to_end(entry.meta.snapshot_id)

    def list_reserved(self, entry: Entry) -> None:
        """Lists a new memory entry, whose bytes were reserved, as most recent."""
        self.reserved -= entry.size
        self.memory_used += entry.size
        self._lru[entry.meta.snapshot_id] = entry
        self.notify()

    def unreserve(self, num_bytes: int, buffer: Buffer | None = None) -> None:
        """Gives back a reservation and, if one was mapped for it, its buffer."""
        self.reserved -= num_bytes
        if buffer is not None:
            self._give_back(buffer)
        self.notify()

    def _give_back(self, buffer: Buffer) -> None:
        """A buffer nobody uses any more: an extent back to the arena, a
        mapping to the pool (still counted there)."""
        if isinstance(buffer, mmap.mmap):
            self.pool.give(buffer, self.clock())
        else:
            assert self.arena is not None
            self.arena.free(buffer)

    def drop(self, entry: Entry) -> None:
        """Unlists an entry; its bytes go now or when its last reader leaves."""
        del self._lru[entry.meta.snapshot_id]
        if entry.path is not None and self.disk is not None:
            self.disk_used -= entry.size
            self.spawn(self.run_io(self.disk.remove, entry.path))
            entry.path = None
        self.settle(entry)
        self.notify()

    def settle(self, entry: Entry) -> None:
        """Frees the memory copy once nobody needs it."""
        if entry.buffer is None or entry.num_readers or entry.residence is Residence.SPILLING:
            return
        if self.lists(entry) and entry.residence is Residence.MEMORY:
            return
        buffer, entry.buffer = entry.buffer, None
        self.memory_used -= entry.size
        self._give_back(buffer)

    def lists(self, entry: Entry) -> bool:
        """Whether `entry` is still listed (not dropped since it was looked up)."""
        return self._lru.get(entry.meta.snapshot_id) is entry

    # -- making room ----------------------------------------------------------

    async def reserve_memory(self, size: int) -> Buffer | None:
        """Counts `size` bytes as reserved, spilling or evicting to make room
        and waiting up to reserve_wait_s for that, or raises ResourceExhausted.
        Returns the buffer if one is ready: the arena's extent, or a pooled
        buffer of exactly `size` bytes (its bytes, counted as pooled, are now
        the reservation); None means the caller maps one.
        The wait is real time (the event loop's), not `clock`, which is for TTLs
        and can be a test's fake."""
        buffer = self.pool.take(size)
        if buffer is not None:
            self.reserved += size
            return buffer
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.reserve_wait_s
        while True:
            if self.arena is not None:
                extent = self.arena.alloc(size)
                if extent is not None:
                    self.reserved += size
                    return extent
            elif self.memory_free() >= size:
                pooled_needed = size - (self.memory_free() - self.pool.num_bytes)
                if pooled_needed <= 0:
                    self.reserved += size
                    return None
                # Pooled bytes count as free: as many as the put needs are
                # unmapped, and it waits below until they are.
                self.pool.release(pooled_needed)
            changed = self._changed
            plan = plan_room(self._lru.values(), self.disk_free(), self._makes_room(size))
            if plan is not None and (plan.spill or plan.evict_memory):
                for entry in plan.evict_disk + plan.evict_memory:
                    self.num_evictions += 1
                    self.drop(entry)
                for entry in plan.spill:
                    self._start_spill(entry)
                continue
            remaining = deadline - loop.time()
            if remaining <= 0 or not self._may_change():
                pieces = ("" if self.arena is None
                          else f", the largest free range {self.arena.largest_free()}")
                raise ResourceExhausted(
                    f"need {size} bytes of memory, {self.memory_free()} free{pieces} of "
                    f"{self.config.memory_budget_bytes} ({self.reserved} reserved by puts "
                    f"in progress, {self.disk_free()} disk bytes free) and no snapshot "
                    "can be spilled or evicted"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    def _makes_room(self, size: int) -> Room:
        """The room for `size` bytes, counting the spills in progress. In an
        arena room must be one range, so only victims that make one long
        enough are worth moving."""
        spilling = [e for e in self._lru.values() if e.residence is Residence.SPILLING]
        if self.arena is not None:
            room: Room = _ArenaRoom(self.arena.runs(), size)
        else:
            room = _BytesRoom(self.memory_free() + self.unmapping, size)
        for entry in spilling:
            room.add(entry)
        return room

    def _may_change(self) -> bool:
        """Whether waiting could help: a spill, a get or another put is running."""
        return (
            bool(self._tasks)
            or self.reserved > 0
            or any(e.num_readers for e in self._lru.values())
        )

    def _start_spill(self, entry: Entry) -> None:
        assert self.disk is not None and entry.buffer is not None
        entry.residence = Residence.SPILLING
        self.disk_reserved += entry.size
        self.spawn(self._spill(entry))

    async def _spill(self, entry: Entry) -> None:
        assert self.disk is not None and entry.buffer is not None
        try:
            path = await self.run_io(self.disk.write, entry.meta, memoryview(entry.buffer),
                                     entry.checksums)
        except Exception:
            log.exception("spilling %s failed; it stays in memory", entry.meta.snapshot_id)
            self.disk_reserved -= entry.size
            entry.residence = Residence.MEMORY
            self.settle(entry)
            self.notify()
            return
        self.disk_reserved -= entry.size
        entry.residence = Residence.DISK
        if self.lists(entry):
            entry.path = path
            self.disk_used += entry.size
            self.num_spills += 1
        else:  # deleted or expired while being written
            self.spawn(self.run_io(self.disk.remove, path))
        self.settle(entry)
        self.notify()

    def memory_free(self) -> int:
        """Budget bytes a put can reserve: pooled buffers count as free,
        those being unmapped do not yet."""
        return (self.config.memory_budget_bytes - self.memory_used - self.reserved
                - self.unmapping)

    def _unmap_soon(self, buffer: mmap.mmap) -> None:
        """Unmaps a buffer on another thread: that takes ~70 ms per GiB, which
        every other call would otherwise wait out. Its bytes stay counted
        until it is gone, so resident memory never exceeds the budget."""
        size = len(buffer)
        self.unmapping += size

        async def unmap() -> None:
            try:
                await asyncio.to_thread(close_now, buffer)
            finally:
                self.unmapping -= size
                self.notify()

        self.spawn(unmap())

    def trim_pool(self, idle_s: float) -> None:
        """Unmaps pooled buffers nobody reused for `idle_s` seconds."""
        self.pool.release_idle(self.clock() - idle_s)

    def disk_free(self) -> int:
        if self.disk is None:
            return 0
        return max(0, self.config.disk_budget_bytes - self.disk_used - self.disk_reserved)

    def check_integrity(self) -> None:
        """Raises AssertionError when the accounting disagrees with the entries
        (lingering entries held only by readers are not checked)."""
        listed = list(self._lru.values())
        in_memory = sum(e.size for e in listed if e.buffer is not None)
        on_disk = sum(e.size for e in listed if e.path is not None)
        assert self.memory_used >= in_memory, (self.memory_used, in_memory)
        assert self.disk_used == on_disk, (self.disk_used, on_disk)
        assert (self.memory_used + self.reserved + self.pool.num_bytes + self.unmapping
                <= self.config.memory_budget_bytes)
        self.pool.check_integrity()
        if self.arena is not None:
            self.arena.check_integrity(self.memory_used + self.reserved)
        assert self.disk_used + self.disk_reserved <= max(self.config.disk_budget_bytes,
                                                           on_disk)
        assert self.reserved >= 0 and self.disk_reserved >= 0

    # -- plumbing -------------------------------------------------------------

    def notify(self) -> None:
        """Wakes puts waiting in `reserve_memory`: something may have freed room."""
        self._changed.set()
        self._changed = asyncio.Event()

    def spawn(self, coro: Any) -> asyncio.Future[Any]:
        """Runs `coro` as a task that `close` waits for (and that counts as a
        change in progress for `reserve_memory`)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        # A put waiting in `reserve_memory` because this was running must look
        # again: it may now be refused at once instead of at its deadline.
        self._tasks.discard(task)
        self.notify()

    async def run_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)
