"""The snapshot store: the cache's API over `Tiers` (puts, deletes, TTL,
stats), with gets on its read side (`SnapshotStore.reads`, cache_svc.reads).

Plain asyncio and no gRPC. A put is `reserve_put` (reserve, or wait for
spills, or ResourceExhausted), `begin_put` (map the buffer) or `release_put`,
`PutSession.accept` per chunk (or, through the arena, the client writes the
extent and `PutSession.accept_written` takes its checksums), then
`commit_put` or `abort_put`. Snapshots idle past their TTL are deleted by
the sweeper, which also trims the buffer pool and the heap.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import mmap
import time
from collections.abc import Callable

from cache_svc.arena import Arena
from cache_svc.buffers import BufferPool
from cache_svc.config import CacheConfig
from cache_svc.ingest import PutSession, allocate, populate
from cache_svc.model import (
    PAGE_BYTES,
    Buffer,
    CacheStats,
    Counters,
    Entry,
    Residence,
    SnapshotInfo,
    TierName,
    pages,
)
from cache_svc.reads import Reads
from cache_svc.snapshot import SnapshotMeta
from cache_svc.tiers import Tiers
from kvstash.common.ids import MAX_FIND_IDS, check_snapshot_id
from kvstash.common.malloc_tuning import trim_heap
from kvstash.common.stats import values
from kvstash.errors import AlreadyExists, InvalidArgument, ResourceExhausted, preview

log = logging.getLogger(__name__)


class SnapshotStore:
    """One cache's snapshots: owns the tiers and the event counts, which its
    put side (here) and its read side (`reads`) share."""

    def __init__(self, config: CacheConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._tiers = Tiers(config, clock)
        # Puts between reserve_put and commit/release, with the pooled buffer
        # reserve_put got for them until begin_put takes it.
        self._pending: dict[str, Buffer | None] = {}
        self._counters = Counters()
        self.reads = Reads(self._tiers, self._counters)

    async def start(self) -> None:
        """Finds the disk tier again after a restart."""
        await self._tiers.recover()

    async def close(self) -> None:
        """Lets running spills and unlinks finish, then stops the I/O threads."""
        await self._tiers.close()

    # -- puts -----------------------------------------------------------------

    async def reserve_put(self, meta: SnapshotMeta) -> None:
        """Counts the snapshot's bytes against the memory budget, waiting for
        spills and other puts to make room, or raises ResourceExhausted. Then
        `begin_put`, or `release_put` if the put ends before that."""
        snapshot_id = meta.snapshot_id
        if self._tiers.is_listed(snapshot_id) or snapshot_id in self._pending:
            raise AlreadyExists(f"snapshot {preview(snapshot_id)} already exists or is being put")
        config = self.config
        budget = config.memory_budget_bytes
        if pages(meta.total_bytes) > budget:
            self._counters.num_refused += 1
            raise ResourceExhausted(
                f"snapshot {preview(snapshot_id)} has {meta.total_bytes} bytes, more than the "
                f"memory budget {budget} (in whole pages of {PAGE_BYTES})"
            )
        if not meta.pinned and pages(meta.total_bytes) > config.unpinned_bytes():
            self._counters.num_refused += 1
            raise ResourceExhausted(
                f"snapshot {preview(snapshot_id)} is unpinned and has {meta.total_bytes} bytes, "
                f"more than unpinned snapshots' share of the memory budget, "
                f"{config.unpinned_share:g} of {budget} (in whole pages of {PAGE_BYTES})"
            )
        if not self._tiers.make_slot(len(self._pending)):
            self._counters.num_refused += 1
            raise ResourceExhausted(
                f"snapshot {preview(snapshot_id)}: the cache lists {self.config.max_snapshots} "
                "snapshots and puts, the most it takes (--max-snapshots), and none of them is "
                "unpinned and idle to evict")
        self._pending[snapshot_id] = None
        try:
            self._pending[snapshot_id] = await self._tiers.reserve_memory(meta.total_bytes,
                                                                          meta.pinned)
        except BaseException as exc:
            if isinstance(exc, ResourceExhausted):
                self._counters.num_refused += 1
            del self._pending[snapshot_id]
            raise

    def begin_put(self, meta: SnapshotMeta) -> PutSession:
        """Maps the reserved buffer, or reuses a pooled one or the arena's
        extent: its old bytes are all overwritten before commit_put lists it
        (see `PutSession`). A thread faults a mapping's pages in meanwhile (at
        once for a pooled, resident buffer, or one only partly faulted in by a
        put that failed); the arena is resident from the start."""
        buffer = self._pending[meta.snapshot_id] or allocate(meta.total_bytes)
        self._pending[meta.snapshot_id] = None
        session = PutSession(meta, buffer)
        if isinstance(buffer, mmap.mmap):
            background = self._tiers.background
            session.populating = background.spawn(
                background.run_io(populate, buffer, session.stop))
        return session

    def release_put(self, meta: SnapshotMeta, buffer: Buffer | None = None,
                    quarantine_s: float = 0.0) -> None:
        """Gives back a reservation that never became a session (or, with the
        session's `buffer`, one whose put failed; the buffer goes to the pool,
        or back to the arena, after `quarantine_s`). The id is free at once."""
        pooled = self._pending.pop(meta.snapshot_id, None)
        self._tiers.unreserve(meta.total_bytes, meta.pinned, buffer or pooled, quarantine_s)

    def commit_shared_put(self, session: PutSession, checksums: list[int]) -> SnapshotInfo:
        """Commits a put whose client wrote the extent itself (see
        `PutSession.accept_written`)."""
        session.accept_written(checksums)
        info = self.commit_put(session)
        self._counters.num_shared_puts += 1
        self._counters.bytes_in += session.meta.total_bytes
        return info

    def commit_put(self, session: PutSession) -> SnapshotInfo:
        session.check_complete()
        session.stop.set()
        meta = session.meta
        entry = Entry(meta, Residence.MEMORY, self._tiers.clock(), tuple(session.checksums),
                      buffer=session.buffer)
        del self._pending[meta.snapshot_id]
        self._tiers.list_reserved(entry)
        self._counters.num_puts += 1
        return SnapshotInfo(meta, entry.tier)

    async def abort_put(self, session: PutSession, quarantine_s: float = 0.0) -> None:
        """Ends a put that will not commit. `quarantine_s`: how long its arena
        extent stays out of reuse, for a client that may still be writing it."""
        self._counters.num_failed_puts += 1
        session.stop.set()
        # The populating thread holds the buffer until its current step ends
        # (milliseconds); the room goes back only then, so resident memory
        # stays in budget. A callback, so it happens even if this is cancelled;
        # registered before wait()'s own, so it has run when this returns.
        populating = session.populating
        if populating is None:
            self.release_put(session.meta, session.buffer, quarantine_s)
            return
        populating.add_done_callback(
            lambda _: self.release_put(session.meta, session.buffer, quarantine_s))
        await asyncio.wait((populating,))

    def count_bytes_in(self, num_bytes: int) -> None:
        self._counters.bytes_in += num_bytes

    # -- the arena (co-located clients) ----------------------------------------

    @property
    def arena(self) -> Arena | None:
        return self._tiers.memory.arena

    def extent_of(self, buffer: Buffer) -> tuple[int, int]:
        """(offset, length) in the arena of a put's or a reader's bytes."""
        arena = self._tiers.memory.arena
        assert arena is not None and isinstance(buffer, memoryview)
        return arena.offset_of(buffer), buffer.nbytes

    # -- deletes, TTL, stats ---------------------------------------------------

    async def delete(self, snapshot_id: str) -> None:
        """Unlists the snapshot at once, and returns once its file, if any, is
        unlinked: a crash after the delete answered cannot bring it back."""
        unlink = self._tiers.drop(self._tiers.lookup(check_snapshot_id(snapshot_id)))
        if unlink is not None:
            await asyncio.shield(unlink)  # a cancelled call still lets it finish

    def stat(self, snapshot_id: str) -> SnapshotInfo:
        entry = self._tiers.lookup(check_snapshot_id(snapshot_id))
        return SnapshotInfo(entry.meta, entry.tier)

    def find(self, snapshot_ids: list[str]) -> list[TierName | None]:
        """Where each of `snapshot_ids` is stored (None: it is not); InvalidArgument
        for a bad id or too many. A snapshot found counts as used (LRU and TTL):
        a prefix segment an instance holds locally too is found at each
        admission and never read, and must not go before segments nobody asks for."""
        if not 0 < len(snapshot_ids) <= MAX_FIND_IDS:
            raise InvalidArgument(f"find takes 1-{MAX_FIND_IDS} snapshot ids, "
                                  f"got {len(snapshot_ids)}")
        tiers = self._tiers
        entries = [tiers.get(check_snapshot_id(snapshot_id)) for snapshot_id in snapshot_ids]
        # Last to first: a prompt's later segments are of no use without its
        # first, so they are the first to go.
        for entry in reversed(entries):
            if entry is not None:
                tiers.touch(entry)
        # Their files' too, in that order, off the event loop: a restart
        # orders the disk tier by mtime (DiskFiles.scan).
        paths = [entry.path for entry in reversed(entries) if entry is not None and entry.path]
        if paths and tiers.disk is not None:
            tiers.background.spawn(tiers.background.run_io(tiers.disk.touch, paths))
        return [None if entry is None else entry.tier for entry in entries]

    def sweep_expired(self) -> int:
        """Deletes idle snapshots past their TTL; returns how many."""
        now = self._tiers.clock()
        expired = [
            e for e in self._tiers.entries()
            if now - e.last_access >= e.meta.ttl_s
            and e.num_readers == 0
            and e.residence is not Residence.SPILLING
        ]
        for entry in expired:
            log.info("snapshot %s expired after %d s idle", entry.meta.snapshot_id,
                     entry.meta.ttl_s)
            self._tiers.drop(entry)
        self._counters.num_expired += len(expired)
        return len(expired)

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.sweep_expired()
            self.trim_buffer_pool()
            # Freed chunk copies go back to the OS: some are freed only by the
            # cycle collector (grpc's objects of a finished call refer to each
            # other and to its last message), then the heap is trimmed. ~5 ms;
            # under traffic, at most one refault of the free heap per sweep.
            gc.collect()
            await self._tiers.background.run_io(trim_heap)

    def trim_buffer_pool(self) -> None:
        """Unmaps pooled buffers no put reused for buffer_pool_idle_s."""
        self._tiers.memory.trim_pool(self.config.buffer_pool_idle_s)

    @property
    def buffer_pool(self) -> BufferPool:
        """For tests and diagnostics; CacheStats mirrors the proto, which has
        no pool fields."""
        return self._tiers.memory.pool

    def stats(self) -> CacheStats:
        """Every counter as it stands, and the tiers' figures now."""
        tiers = self._tiers
        listed = list(tiers.entries())
        return CacheStats(
            **values(self._counters),
            num_evictions=tiers.num_evictions,
            num_spills=tiers.num_spills,
            memory_bytes=tiers.memory.used,
            memory_budget_bytes=self.config.memory_budget_bytes,
            memory_snapshots=sum(1 for e in listed if e.residence is not Residence.DISK),
            disk_bytes=tiers.disk_used,
            disk_budget_bytes=self.config.disk_budget_bytes,
            disk_snapshots=sum(1 for e in listed if e.residence is Residence.DISK),
            pinned_bytes=sum(e.disk_bytes if e.residence is Residence.DISK else e.memory_bytes
                             for e in listed if e.meta.pinned),
            reserved_bytes=tiers.memory.reserved,
            free_bytes=tiers.memory.free() + tiers.disk_free(),
        )

    def check_integrity(self) -> None:
        """Raises AssertionError when the accounting disagrees with the entries
        or with the puts in progress."""
        self._tiers.check_integrity()
        assert not self._pending.keys() & {e.meta.snapshot_id for e in self._tiers.entries()}

