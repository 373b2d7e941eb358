"""The snapshot store: reservations, the two tiers, LRU, pinning and TTL.

Plain asyncio and no gRPC. All bookkeeping happens on the event loop; disk
work runs in a thread pool. Accounting invariants (see `check_integrity`):

    memory_used + reserved       <= memory budget   (buffers of puts in progress
                                                     are preallocated, so counted)
    disk_used + disk_reserved    <= disk budget     (disk_reserved: spills running)

A put is `reserve_put` (reserve, or wait for spills, or ResourceExhausted),
`begin_put` (map the buffer) or `release_put`, `PutSession.accept` per
chunk, then `commit_put` or `abort_put`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cache_svc.config import CacheConfig
from cache_svc.disk import DiskFiles
from cache_svc.eviction import plan_room
from cache_svc.ingest import PutSession, allocate, populate
from cache_svc.model import CacheStats, Counters, Entry, Residence, SnapshotInfo
from cache_svc.snapshot import SnapshotMeta, checksum
from kvstash.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Reader:
    """A get in progress; holds the entry busy until `close_reader`."""

    entry: Entry
    fd: int | None  # open file when the bytes are only on disk

    @property
    def meta(self) -> SnapshotMeta:
        return self.entry.meta


class SnapshotStore:
    def __init__(self, config: CacheConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._disk = (
            DiskFiles(config.disk_dir, config.disk_write_bytes_per_s) if config.disk_dir else None
        )
        self._io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="cache-io")
        # Listed snapshots, least recently used first.
        self._lru: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self._pending_ids: set[str] = set()
        self._memory_used = 0
        self._reserved = 0
        self._disk_used = 0
        self._disk_reserved = 0
        self._counters = Counters()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Finds the disk tier again after a restart."""
        if self._disk is None:
            return
        found = await self._run_io(self._disk.scan)
        now = self._clock()
        for snap in found:  # oldest first, so LRU order survives a restart
            entry = Entry(snap.meta, Residence.DISK, now, path=snap.path)
            self._lru[snap.meta.snapshot_id] = entry
            self._disk_used += entry.size
        if found:
            log.info("disk tier: recovered %d snapshots, %d bytes", len(found), self._disk_used)

    async def close(self) -> None:
        """Lets running spills and unlinks finish, then stops the I/O threads."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._io.shutdown(wait=True)

    # -- puts -----------------------------------------------------------------

    async def reserve_put(self, meta: SnapshotMeta) -> None:
        """Counts the snapshot's bytes against the memory budget, waiting for
        spills and other puts to make room, or raises ResourceExhausted. Then
        `begin_put`, or `release_put` if the put ends before that."""
        snapshot_id = meta.snapshot_id
        if snapshot_id in self._lru or snapshot_id in self._pending_ids:
            raise AlreadyExists(f"snapshot {snapshot_id} already exists or is being put")
        size = meta.total_bytes
        budget = self.config.memory_budget_bytes
        if size > budget:
            self._counters.num_refused += 1
            raise ResourceExhausted(
                f"snapshot {snapshot_id} has {size} bytes, more than the memory budget {budget}"
            )
        self._pending_ids.add(snapshot_id)
        try:
            await self._reserve_memory(size)
        except BaseException:
            self._pending_ids.discard(snapshot_id)
            raise

    def begin_put(self, meta: SnapshotMeta) -> PutSession:
        """Maps the reserved buffer; a thread faults its pages in meanwhile."""
        session = PutSession(meta, allocate(meta.total_bytes))
        session.populating = self._spawn(self._run_io(populate, session.buffer, session.stop))
        return session

    def release_put(self, meta: SnapshotMeta) -> None:
        """Gives back a reservation that never became a session."""
        self._reserved -= meta.total_bytes
        self._pending_ids.discard(meta.snapshot_id)
        self._notify()

    def commit_put(self, session: PutSession) -> SnapshotInfo:
        session.check_complete()
        session.stop.set()
        meta = session.meta
        entry = Entry(meta, Residence.MEMORY, self._clock(), buffer=session.buffer,
                      checksums=tuple(session.checksums))
        self._reserved -= meta.total_bytes
        self._memory_used += meta.total_bytes
        self._pending_ids.discard(meta.snapshot_id)
        self._lru[meta.snapshot_id] = entry
        self._counters.num_puts += 1
        self._notify()
        return SnapshotInfo(meta, entry.tier)

    async def abort_put(self, session: PutSession) -> None:
        self._counters.num_failed_puts += 1
        session.stop.set()
        # The populating thread holds the buffer until its current step ends
        # (milliseconds); the room goes back only then, so resident memory
        # stays in budget. A callback, so it happens even if this is cancelled;
        # registered before wait()'s own, so it has run when this returns.
        populating = session.populating
        assert populating is not None
        populating.add_done_callback(lambda _: self.release_put(session.meta))
        await asyncio.wait((populating,))

    def count_bytes_in(self, num_bytes: int) -> None:
        self._counters.bytes_in += num_bytes

    async def _reserve_memory(self, size: int) -> None:
        deadline = self._clock() + self.config.reserve_wait_s
        while True:
            if self._memory_free() >= size:
                self._reserved += size
                return
            changed = self._changed
            spilling = sum(e.size for e in self._lru.values() if e.residence is Residence.SPILLING)
            shortfall = size - self._memory_free() - spilling
            if shortfall > 0:
                plan = plan_room(self._lru.values(), shortfall, self._disk_free())
                if plan is not None:
                    for entry in plan.evict_disk + plan.evict_memory:
                        self._counters.num_evictions += 1
                        self._drop(entry)
                    for entry in plan.spill:
                        self._start_spill(entry)
                    continue
            remaining = deadline - self._clock()
            if remaining <= 0 or not self._may_change():
                self._counters.num_refused += 1
                raise ResourceExhausted(
                    f"need {size} bytes of memory, {self._memory_free()} free of "
                    f"{self.config.memory_budget_bytes} ({self._reserved} reserved by puts "
                    f"in progress, {self._disk_free()} disk bytes free) and no snapshot "
                    "can be spilled or evicted"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    def _may_change(self) -> bool:
        """Whether waiting could help: a spill, a get or another put is running."""
        return (
            bool(self._tasks)
            or self._reserved > 0
            or any(e.num_readers for e in self._lru.values())
        )

    # -- spills and removal ---------------------------------------------------

    def _start_spill(self, entry: Entry) -> None:
        assert self._disk is not None and entry.buffer is not None
        entry.residence = Residence.SPILLING
        self._disk_reserved += entry.size
        self._spawn(self._spill(entry))

    async def _spill(self, entry: Entry) -> None:
        assert self._disk is not None and entry.buffer is not None
        try:
            path = await self._run_io(self._disk.write, entry.meta, memoryview(entry.buffer))
        except Exception:
            log.exception("spilling %s failed; it stays in memory", entry.meta.snapshot_id)
            self._disk_reserved -= entry.size
            entry.residence = Residence.MEMORY
            self._settle(entry)
            self._notify()
            return
        self._disk_reserved -= entry.size
        entry.residence = Residence.DISK
        if self._listed(entry):
            entry.path = path
            self._disk_used += entry.size
            self._counters.num_spills += 1
        else:  # deleted or expired while being written
            self._spawn(self._run_io(self._disk.remove, path))
        self._settle(entry)
        self._notify()

    def _drop(self, entry: Entry) -> None:
        """Unlists an entry; its bytes go now or when its last reader leaves."""
        del self._lru[entry.meta.snapshot_id]
        if entry.path is not None and self._disk is not None:
            self._disk_used -= entry.size
            self._spawn(self._run_io(self._disk.remove, entry.path))
            entry.path = None
        self._settle(entry)
        self._notify()

    def _settle(self, entry: Entry) -> None:
        """Frees the memory copy once nobody needs it."""
        if entry.buffer is None or entry.num_readers or entry.residence is Residence.SPILLING:
            return
        if self._listed(entry) and entry.residence is Residence.MEMORY:
            return
        entry.buffer = None  # the mmap is unmapped when its last reference goes
        self._memory_used -= entry.size

    def _listed(self, entry: Entry) -> bool:
        return self._lru.get(entry.meta.snapshot_id) is entry

    # -- gets, deletes, stats -------------------------------------------------

    async def open_reader(self, snapshot_id: str, start_chunk: int = 0) -> Reader:
        entry = self._lookup(snapshot_id)
        if start_chunk > entry.meta.num_chunks:
            raise InvalidArgument(
                f"start_chunk {start_chunk} is past the last chunk: snapshot {snapshot_id} "
                f"has {entry.meta.num_chunks} chunks"
            )
        entry.num_readers += 1
        self._touch(entry)
        self._counters.num_gets += 1
        fd = None
        if entry.buffer is None:
            assert self._disk is not None and entry.path is not None
            try:
                fd = await self._run_io(self._disk.open, entry.path)
            except BaseException:
                self.close_reader(Reader(entry, None))
                raise
        return Reader(entry, fd)

    async def read_chunk(self, reader: Reader, index: int) -> tuple[bytes | memoryview, int]:
        """Chunk `index` and its checksum. From memory it is a view of the
        snapshot buffer (valid while the reader is open), not a copy."""
        start, end = reader.meta.chunk_range(index)
        if reader.fd is None:
            assert reader.entry.buffer is not None
            data: bytes | memoryview = memoryview(reader.entry.buffer)[start:end]
        else:
            assert self._disk is not None
            data = await self._run_io(self._disk.read, reader.fd, start, end)
        checksums = reader.entry.checksums
        digest = checksums[index] if checksums is not None else checksum(data)
        self._counters.bytes_out += end - start
        return data, digest

    def close_reader(self, reader: Reader) -> None:
        if reader.fd is not None:
            self._spawn(self._run_io(os.close, reader.fd))
            reader.fd = None
        reader.entry.num_readers -= 1
        self._settle(reader.entry)
        self._notify()

    def delete(self, snapshot_id: str) -> None:
        self._drop(self._lookup(snapshot_id))

    def stat(self, snapshot_id: str) -> SnapshotInfo:
        entry = self._lookup(snapshot_id)
        return SnapshotInfo(entry.meta, entry.tier)

    def sweep_expired(self) -> int:
        """Deletes idle snapshots past their TTL; returns how many."""
        now = self._clock()
        expired = [
            e for e in self._lru.values()
            if now - e.last_access >= e.meta.ttl_s
            and e.num_readers == 0
            and e.residence is not Residence.SPILLING
        ]
        for entry in expired:
            log.info("snapshot %s expired after %d s idle", entry.meta.snapshot_id,
                     entry.meta.ttl_s)
            self._drop(entry)
        self._counters.num_expired += len(expired)
        return len(expired)

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.sweep_expired()

    def stats(self) -> CacheStats:
        listed = self._lru.values()
        c = self._counters
        return CacheStats(
            memory_bytes=self._memory_used,
            memory_budget_bytes=self.config.memory_budget_bytes,
            memory_snapshots=sum(1 for e in listed if e.residence is not Residence.DISK),
            disk_bytes=self._disk_used,
            disk_budget_bytes=self.config.disk_budget_bytes,
            disk_snapshots=sum(1 for e in listed if e.residence is Residence.DISK),
            pinned_bytes=sum(e.size for e in listed if e.meta.pinned),
            reserved_bytes=self._reserved,
            num_puts=c.num_puts, num_gets=c.num_gets, num_refused=c.num_refused,
            num_failed_puts=c.num_failed_puts, num_evictions=c.num_evictions,
            num_spills=c.num_spills, num_expired=c.num_expired,
            bytes_in=c.bytes_in, bytes_out=c.bytes_out,
            free_bytes=self._memory_free() + self._disk_free(),
        )

    def check_integrity(self) -> None:
        """Raises AssertionError when the accounting disagrees with the entries
        (lingering entries held only by readers are not checked)."""
        listed = list(self._lru.values())
        in_memory = sum(e.size for e in listed if e.buffer is not None)
        on_disk = sum(e.size for e in listed if e.path is not None)
        assert self._memory_used >= in_memory, (self._memory_used, in_memory)
        assert self._disk_used == on_disk, (self._disk_used, on_disk)
        assert self._memory_used + self._reserved <= self.config.memory_budget_bytes
        assert self._disk_used + self._disk_reserved <= max(self.config.disk_budget_bytes,
                                                             on_disk)
        assert self._reserved >= 0 and self._disk_reserved >= 0

    # -- helpers --------------------------------------------------------------

    def _lookup(self, snapshot_id: str) -> Entry:
        entry = self._lru.get(snapshot_id)
        if entry is None:
            raise NotFound(f"snapshot {snapshot_id} not found")
        return entry

    def _touch(self, entry: Entry) -> None:
        entry.last_access = self._clock()
        self._lru.move_to_end(entry.meta.snapshot_id)

    def _memory_free(self) -> int:
        return self.config.memory_budget_bytes - self._memory_used - self._reserved

    def _disk_free(self) -> int:
        if self._disk is None:
            return 0
        return max(0, self.config.disk_budget_bytes - self._disk_used - self._disk_reserved)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _spawn(self, coro: Any) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _run_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)
