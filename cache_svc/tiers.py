"""The two tiers and the listing: where each listed snapshot's bytes live,
and making memory room by spilling or evicting.

Mechanism only; `SnapshotStore` decides what to list, read and drop, and
cache_svc.eviction which snapshots make room. Plain asyncio and no gRPC:
bookkeeping happens on the event loop, disk work in a thread pool
(cache_svc.background). The memory tier's buffers and figures are
cache_svc.memory_tier's, with its invariant; the disk tier's are here
(see `check_integrity`):

    disk_used + disk_reserved    <= disk budget     (disk_reserved: spills running)

Why one file over 300 lines: each move between the tiers (a reservation, a
spill, an eviction, a drop) changes the listing, both tiers' figures and the
room a waiting put sees, together, on the event loop; which snapshots move
is eviction.py's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterable

from cache_svc.background import Background
from cache_svc.config import CacheConfig
from cache_svc.disk import DiskFiles
from cache_svc.eviction import CappedRoom, Room, over_limits, plan_room, slot_victims
from cache_svc.memory_tier import MemoryTier
from cache_svc.model import Buffer, Entry, Residence, pages
from kvstash.errors import NotFound, ResourceExhausted, preview

log = logging.getLogger(__name__)

# After a spill fails, no snapshot is spilled for this long (nor one on disk
# evicted to make room for a spill): a full or failing disk would otherwise be
# written to again at once, a whole snapshot at a time, for as long as a put
# waits for room.
SPILL_BACKOFF_S = 5.0


class Tiers:
    def __init__(self, config: CacheConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.disk = (
            DiskFiles(config.disk_dir, config.disk_write_bytes_per_s) if config.disk_dir else None
        )
        self.background = Background(config.io_threads)
        self.memory = MemoryTier(config, clock, self.background)
        # Listed snapshots, least recently used first.
        self._lru: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self.disk_used = 0
        self.disk_reserved = 0
        self.unpinned_reserved = 0  # of memory.reserved, by puts of unpinned snapshots
        self.num_evictions = 0
        self.num_spills = 0
        self._spills_paused_until = -math.inf  # event-loop time (SPILL_BACKOFF_S)

    async def recover(self) -> None:
        """Lists the disk tier's snapshots again after a restart."""
        if self.disk is None:
            return
        await self.background.run_io(self.disk.lock)
        found = await self.background.run_io(self.disk.scan)
        now = self.clock()
        for snap in found:  # oldest first, so LRU order survives a restart
            # Idle since its file was last written, read or found: a TTL does not
            # start again at each restart (a crash loop kept orphans forever).
            entry = Entry(snap.meta, Residence.DISK, now - snap.idle_s, snap.checksums,
                          path=snap.path)
            self._lru[snap.meta.snapshot_id] = entry
            self.disk_used += entry.disk_bytes
        if found:
            log.info("disk tier: recovered %d snapshots, %d bytes", len(found), self.disk_used)
        victims, over, extra = over_limits(self._lru.values(), self.disk_used,
                                           self.config.disk_budget_bytes,
                                           self.config.max_snapshots)
        self._evict(victims)
        if over or extra:
            log.warning("disk tier: pinned snapshots alone hold %d bytes and %d snapshots more "
                        "than its budget and max_snapshots allow, until they are deleted or "
                        "expire", over, extra)

    async def close(self) -> None:
        """Lets running spills, unlinks and unmaps finish, then stops the I/O
        threads."""
        memory = self.memory
        memory.pool.release(memory.pool.num_bytes)
        await self.background.close()
        memory.close()
        if self.disk is not None:
            self.disk.unlock()

    # -- listing --------------------------------------------------------------

    def entries(self) -> Iterable[Entry]:
        """Listed entries, least recently used first."""
        return self._lru.values()

    def is_listed(self, snapshot_id: str) -> bool:
        return snapshot_id in self._lru

    def get(self, snapshot_id: str) -> Entry | None:
        return self._lru.get(snapshot_id)

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
        self.memory.reserved -= entry.memory_bytes
        if not entry.meta.pinned:
            self.unpinned_reserved -= entry.memory_bytes
        self.memory.used += entry.memory_bytes
        self._lru[entry.meta.snapshot_id] = entry
        self.background.notify()

    def unreserve(self, total_bytes: int, pinned: bool, buffer: Buffer | None = None,
                  quarantine_s: float = 0.0) -> None:
        """Gives back reserve_memory's reservation and, if one was mapped for
        it, its buffer (an arena extent after `quarantine_s`, see
        MemoryTier.give_back)."""
        size = pages(total_bytes)
        self.memory.reserved -= size
        if not pinned:
            self.unpinned_reserved -= size
        if buffer is not None:
            self.memory.give_back(buffer, quarantine_s)
        self.background.notify()

    def drop(self, entry: Entry) -> asyncio.Future[None] | None:
        """Unlists an entry; its bytes go now or when its last reader leaves.
        Returns what is done once its file is gone, if it has one (or one is
        being written: see `_spill`)."""
        del self._lru[entry.meta.snapshot_id]
        unlink = None
        if entry.path is not None and self.disk is not None:
            self.disk_used -= entry.disk_bytes
            unlink = self.background.spawn(self.background.run_unlink(
                functools.partial(self.disk.remove, entry.path), self.disk.sync_dir))
            entry.path = None
        elif entry.residence is Residence.SPILLING:
            unlink = entry.unlinked = asyncio.get_running_loop().create_future()
        self.settle(entry)
        self.background.notify()
        return unlink

    def settle(self, entry: Entry) -> None:
        """Frees the memory copy once nobody needs it."""
        if entry.buffer is None or entry.num_readers or entry.residence is Residence.SPILLING:
            return
        if self.lists(entry) and entry.residence is Residence.MEMORY:
            return
        buffer, entry.buffer = entry.buffer, None
        self.memory.used -= entry.memory_bytes
        self.memory.give_back(buffer)

    def lists(self, entry: Entry) -> bool:
        """Whether `entry` is still listed (not dropped since it was looked up)."""
        return self._lru.get(entry.meta.snapshot_id) is entry

    # -- making room ----------------------------------------------------------

    def make_slot(self, num_pending: int) -> bool:
        """Room in the listing for one more snapshot, `num_pending` puts
        holding theirs (max_snapshots): the least recently used unpinned
        snapshot nobody is reading or spilling goes if need be; False if none can."""
        over = len(self._lru) + num_pending + 1 - self.config.max_snapshots
        victims = slot_victims(self._lru.values(), over) if over > 0 else []
        if victims is None:
            return False
        self._evict(victims)
        return True

    def _evict(self, victims: list[Entry]) -> None:
        for victim in victims:
            self.num_evictions += 1
            self.drop(victim)

    async def reserve_memory(self, total_bytes: int, pinned: bool = True) -> Buffer | None:
        """Counts a buffer of `total_bytes` (its whole pages, model.pages) as
        reserved, spilling or evicting to make room and waiting up to
        reserve_wait_s for that, or raises ResourceExhausted.
        An unpinned snapshot displaces only unpinned ones, and keeps unpinned
        ones within their share of the budget (eviction.py).
        Returns the buffer if one is ready: the arena's extent, or a pooled
        buffer of exactly `total_bytes` (its bytes, counted as pooled, are now
        the reservation); None means the caller maps one.
        The wait is real time (the event loop's), not `clock`, which is for TTLs
        and can be a test's fake."""
        memory = self.memory
        size = pages(total_bytes)
        buffer = (memory.pool.take(total_bytes) if self._unpinned_excess(size, pinned) <= 0
                  else None)
        if buffer is not None:
            self._count_reserved(size, pinned)
            return buffer
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.reserve_wait_s
        while True:
            excess = self._unpinned_excess(size, pinned)  # > 0: move unpinned out first
            if excess <= 0 and memory.arena is not None:
                extent = memory.arena.alloc(total_bytes)
                if extent is not None:
                    self._count_reserved(size, pinned)
                    return extent
            elif excess <= 0 and memory.free() >= size:
                pooled_needed = size - (memory.free() - memory.pool.num_bytes)
                if pooled_needed <= 0:
                    self._count_reserved(size, pinned)
                    return None
                # Pooled bytes count as free: as many as the put needs are
                # unmapped, and it waits below until they are.
                memory.pool.release(pooled_needed)
            changed = self.background.changed
            room = self._makes_room(size)
            plan = plan_room(self._lru.values(), self.disk_free(overdrawn=True),
                             room if excess <= 0 else CappedRoom(room, excess),
                             unpinned_only=not pinned,
                             spill=loop.time() >= self._spills_paused_until)
            if plan is not None and (plan.spill or plan.evict_memory):
                self._evict(plan.evict_disk + plan.evict_memory)
                for entry in plan.spill:
                    self._start_spill(entry)
                continue
            remaining = deadline - loop.time()
            if remaining <= 0 or not self._may_change():
                pieces = ("" if memory.arena is None
                          else f", the largest free range {memory.arena.largest_free()}, "
                               f"{memory.quarantined} quarantined")
                share = ("" if pinned else
                         f"; unpinned, within {self.config.unpinned_share:g} of the budget "
                         f"({max(0, excess)} bytes over), displacing no pinned snapshot")
                raise ResourceExhausted(
                    f"need {size} bytes of memory, {memory.free()} free{pieces} of "
                    f"{self.config.memory_budget_bytes} ({memory.reserved} reserved by puts "
                    f"in progress, {self.disk_free()} disk bytes free) and no snapshot "
                    f"can be spilled or evicted{share}"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    def _count_reserved(self, size: int, pinned: bool) -> None:
        self.memory.reserved += size
        if not pinned:
            self.unpinned_reserved += size

    def _unpinned_excess(self, size: int, pinned: bool) -> int:
        """Bytes an unpinned put of `size` would take unpinned snapshots in
        memory (and puts of them in progress) over their share of the budget;
        0 or less: none (a pinned put)."""
        if pinned:
            return 0
        held = self.unpinned_reserved + sum(
            e.memory_bytes for e in self._lru.values()
            if not e.meta.pinned and e.residence is Residence.MEMORY)
        return held + size - self.config.unpinned_bytes()

    def _makes_room(self, size: int) -> Room:
        """The room for `size` bytes, counting the spills in progress."""
        room = self.memory.room_for(size)
        for entry in self._lru.values():
            if entry.residence is Residence.SPILLING:
                room.add(entry)
        return room

    def _may_change(self) -> bool:
        """Whether waiting could help: a spill, a get or another put is
        running, or an extent's quarantine. A get of a snapshot no longer
        listed counts too: its memory copy is freed when it ends."""
        listed = self._lru.values()
        return (
            self.background.busy
            or self.memory.reserved > 0
            or self.memory.quarantined > 0
            or any(e.num_readers for e in listed)
            or self.memory.used > sum(e.memory_bytes for e in listed if e.buffer is not None)
        )

    def _start_spill(self, entry: Entry) -> None:
        assert self.disk is not None and entry.buffer is not None
        entry.residence = Residence.SPILLING
        self.disk_reserved += entry.disk_bytes
        self.background.spawn(self._spill(entry))

    async def _spill(self, entry: Entry) -> None:
        assert self.disk is not None and entry.buffer is not None
        background = self.background
        try:
            # Asked on the I/O thread: a snapshot dropped while being written
            # is never put in place, where after a crash it would be the
            # newest file of its id (disk.scan), over one put since. One
            # dropped just after the check was written before any such one.
            path = await background.run_io(self.disk.write, entry.meta,
                                           memoryview(entry.buffer), entry.checksums,
                                           lambda: self.lists(entry))
        except Exception:
            log.exception("spilling %s failed; it stays in memory, and no snapshot is spilled "
                          "for %g s", entry.meta.snapshot_id, SPILL_BACKOFF_S)
            self._spills_paused_until = asyncio.get_running_loop().time() + SPILL_BACKOFF_S
            self.disk_reserved -= entry.disk_bytes
            entry.residence = Residence.MEMORY
            self.settle(entry)
            background.notify()
            _done(entry.unlinked)  # no file was left
            return
        self.disk_reserved -= entry.disk_bytes
        entry.residence = Residence.DISK
        if path is None:  # deleted or expired while being written
            _done(entry.unlinked)
        elif self.lists(entry):
            entry.path = path
            self.disk_used += entry.disk_bytes
            self.num_spills += 1
        else:  # deleted or expired just before its file was put in place
            unlink = background.spawn(background.run_unlink(
                functools.partial(self.disk.remove, path), self.disk.sync_dir))
            unlink.add_done_callback(lambda _: _done(entry.unlinked))
        self.settle(entry)
        background.notify()

    def disk_free(self, overdrawn: bool = False) -> int:
        """Disk budget bytes not used or reserved; with `overdrawn`, below 0 by
        what the disk holds beyond it (recovered under a smaller budget): a
        spill then evicts that much more first."""
        if self.disk is None:
            return 0
        free = self.config.disk_budget_bytes - self.disk_used - self.disk_reserved
        return free if overdrawn else max(0, free)

    def check_integrity(self) -> None:
        """Raises AssertionError when the accounting disagrees with the entries
        (lingering entries held only by readers are not checked)."""
        listed = list(self._lru.values())
        on_disk = sum(e.disk_bytes for e in listed if e.path is not None)
        self.memory.check_integrity(sum(e.memory_bytes for e in listed if e.buffer is not None))
        assert self.disk_used == on_disk, (self.disk_used, on_disk)
        assert self.disk_used + self.disk_reserved <= max(self.config.disk_budget_bytes,
                                                           on_disk)
        assert self.disk_reserved >= 0
        assert 0 <= self.unpinned_reserved <= self.memory.reserved


def _done(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)
