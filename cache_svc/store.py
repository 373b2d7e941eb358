"""The snapshot store: the cache's API over `Tiers` (puts, gets, deletes, TTL).

Plain asyncio and no gRPC. A put is `reserve_put` (reserve, or wait for
spills, or ResourceExhausted), `begin_put` (map the buffer) or `release_put`,
`PutSession.accept` per chunk (or, through the arena, the client writes the
extent and `PutSession.accept_written` takes its checksums), then
`commit_put` or `abort_put`. A get is `open_reader`, `read_chunk` per chunk
(or, through the arena, the client reads `extent_of` itself), then
`close_reader`; disk failures during a get are DataLoss or Unavailable naming
the snapshot and chunk. A consuming get deletes the snapshot when it closes
having read every chunk.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cache_svc.arena import Arena
from cache_svc.buffers import BufferPool
from cache_svc.config import CacheConfig
from cache_svc.ingest import PutSession, allocate, populate
from cache_svc.model import Buffer, CacheStats, Counters, Entry, Residence, SnapshotInfo
from cache_svc.snapshot import SnapshotMeta
from cache_svc.tiers import Tiers
from kvstash.common.ids import check_snapshot_id
from kvstash.common.malloc_tuning import trim_heap
from kvstash.common.stats import values
from kvstash.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    KvstashError,
    ResourceExhausted,
    Unavailable,
    preview,
)

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Reader:
    """A get in progress; holds the entry busy until `close_reader`."""

    entry: Entry
    fd: int | None  # open file when the bytes are only on disk
    # The file `fd` was opened from (for messages): a delete meanwhile unsets
    # entry.path, while the open file still reads.
    path: Path | None = None
    consume: bool = False  # delete the snapshot once every chunk has been read

    @property
    def meta(self) -> SnapshotMeta:
        return self.entry.meta


class SnapshotStore:
    def __init__(self, config: CacheConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._tiers = Tiers(config, clock)
        # Puts between reserve_put and commit/release, with the pooled buffer
        # reserve_put got for them until begin_put takes it.
        self._pending: dict[str, Buffer | None] = {}
        self._counters = Counters()

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
        size = meta.total_bytes
        budget = self.config.memory_budget_bytes
        if size > budget:
            self._counters.num_refused += 1
            raise ResourceExhausted(
                f"snapshot {preview(snapshot_id)} has {size} bytes, more than the memory "
                f"budget {budget}"
            )
        self._pending[snapshot_id] = None
        try:
            self._pending[snapshot_id] = await self._tiers.reserve_memory(size)
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
            tiers = self._tiers
            session.populating = tiers.spawn(tiers.run_io(populate, buffer, session.stop))
        return session

    def release_put(self, meta: SnapshotMeta, buffer: Buffer | None = None) -> None:
        """Gives back a reservation that never became a session (or, with the
        session's `buffer`, one whose put failed; the buffer goes to the pool)."""
        pooled = self._pending.pop(meta.snapshot_id, None)
        self._tiers.unreserve(meta.total_bytes, buffer or pooled)

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

    async def abort_put(self, session: PutSession) -> None:
        self._counters.num_failed_puts += 1
        session.stop.set()
        # The populating thread holds the buffer until its current step ends
        # (milliseconds); the room goes back only then, so resident memory
        # stays in budget. A callback, so it happens even if this is cancelled;
        # registered before wait()'s own, so it has run when this returns.
        populating = session.populating
        if populating is None:
            self.release_put(session.meta, session.buffer)
            return
        populating.add_done_callback(lambda _: self.release_put(session.meta, session.buffer))
        await asyncio.wait((populating,))

    def count_bytes_in(self, num_bytes: int) -> None:
        self._counters.bytes_in += num_bytes

    # -- the arena (co-located clients) ----------------------------------------

    @property
    def arena(self) -> Arena | None:
        return self._tiers.arena

    def extent_of(self, buffer: Buffer) -> tuple[int, int]:
        """(offset, length) in the arena of a put's or a reader's bytes."""
        arena = self._tiers.arena
        assert arena is not None and isinstance(buffer, memoryview)
        return arena.offset_of(buffer), buffer.nbytes

    async def open_shared_reader(self, snapshot_id: str, consume: bool) -> Reader:
        """`open_reader` for a client that reads the arena itself: the
        snapshot must be in memory (FailedPrecondition otherwise); it is
        counted as read out in full."""
        entry = self._tiers.lookup(check_snapshot_id(snapshot_id))
        if self._tiers.arena is None or entry.buffer is None:
            raise FailedPrecondition(
                f"snapshot {preview(snapshot_id)} is not in the arena "
                f"({'on disk' if entry.buffer is None else 'this cache has none'}); "
                "read it with GetSnapshot"
            )
        reader = await self.open_reader(snapshot_id, consume=consume)
        self._counters.bytes_out += entry.size
        self._counters.num_shared_gets += 1
        return reader

    # -- gets, deletes, stats -------------------------------------------------

    async def open_reader(
        self, snapshot_id: str, start_chunk: int = 0, consume: bool = False
    ) -> Reader:
        """Holds the snapshot (never spilled, evicted or expired meanwhile) until
        `close_reader`. With `consume`, that deletes it if the get finished."""
        tiers = self._tiers
        entry = tiers.lookup(check_snapshot_id(snapshot_id))
        if start_chunk > entry.meta.num_chunks:
            raise InvalidArgument(
                f"start_chunk {start_chunk} is past the last chunk: snapshot "
                f"{preview(snapshot_id)} "
                f"has {entry.meta.num_chunks} chunks"
            )
        entry.num_readers += 1
        tiers.touch(entry)
        self._counters.num_gets += 1
        fd = None
        if entry.buffer is None:
            assert tiers.disk is not None and entry.path is not None
            path = entry.path
            try:
                fd = await tiers.run_io(tiers.disk.open, path)
            except BaseException as exc:
                self.close_reader(Reader(entry, None))
                if isinstance(exc, OSError):
                    raise self._disk_failure(entry, path, start_chunk, exc) from exc
                raise
            return Reader(entry, fd, path, consume)
        return Reader(entry, None, consume=consume)

    async def read_chunk(self, reader: Reader, index: int) -> tuple[bytes | memoryview, int]:
        """Chunk `index` and the checksum verified when it was put (never one
        computed from what was read, so damage at rest reaches the client as
        a mismatch). From memory the chunk is a view of the snapshot buffer
        (valid while the reader is open), not a copy."""
        entry = reader.entry
        start, end = entry.meta.chunk_range(index)
        if reader.fd is None:
            assert entry.buffer is not None
            data: bytes | memoryview = memoryview(entry.buffer)[start:end]
        else:
            disk = self._tiers.disk
            assert disk is not None and reader.path is not None
            try:
                data = await self._tiers.run_io(disk.read, reader.fd, start, end)
            except (OSError, DataLoss) as exc:
                raise self._disk_failure(entry, reader.path, index, exc) from exc
        self._counters.bytes_out += end - start
        return data, entry.checksums[index]

    def _disk_failure(
        self, entry: Entry, path: Path, index: int, exc: OSError | DataLoss
    ) -> KvstashError:
        """The error a get reports when the disk tier fails it. A file that
        vanished because the snapshot was dropped meanwhile (delete, TTL,
        eviction) is UNAVAILABLE: a retry sees NOT_FOUND. A listed snapshot
        whose file is missing or short is lost: it is unlisted (so it stops
        counting and failing) and the get is DATA_LOSS. Other I/O errors may
        pass (descriptors, memory), so UNAVAILABLE."""
        sid = entry.meta.snapshot_id
        # The client is told the snapshot and chunk; the log names the file.
        where = f"snapshot {preview(sid)}, chunk {index}"
        if isinstance(exc, FileNotFoundError) and not self._tiers.lists(entry):
            return Unavailable(f"{where}: the snapshot was deleted while being read")
        if isinstance(exc, FileNotFoundError | DataLoss):
            what = "the file is missing" if isinstance(exc, OSError) else str(exc)
            if self._tiers.lists(entry):
                log.error("snapshot %s is lost and unlisted: %s: %s", sid, path, what)
                self._tiers.drop(entry)
            return DataLoss(f"{where}: {what}; the snapshot is lost")
        log.warning("snapshot %s, chunk %d: reading %s failed: %s", sid, index, path, exc)
        return Unavailable(f"{where}: reading from disk failed: {exc.strerror or exc}")

    def close_reader(self, reader: Reader, finished: bool = False) -> None:
        """Ends a get; `finished` says every chunk it asked for was sent. A
        finished consuming get deletes the snapshot, unless it was dropped (or
        dropped and put again) meanwhile. Other gets of it read on: a memory
        copy is freed, and an unlinked file's space returned, once the last
        of them closes."""
        tiers = self._tiers
        entry = reader.entry
        if reader.fd is not None:
            tiers.spawn(tiers.run_io(os.close, reader.fd))
            reader.fd = None
        if finished and reader.consume and tiers.lists(entry):
            tiers.drop(entry)
            self._counters.num_consumed += 1
        entry.num_readers -= 1
        tiers.settle(entry)
        tiers.notify()

    def delete(self, snapshot_id: str) -> None:
        self._tiers.drop(self._tiers.lookup(check_snapshot_id(snapshot_id)))

    def stat(self, snapshot_id: str) -> SnapshotInfo:
        entry = self._tiers.lookup(check_snapshot_id(snapshot_id))
        return SnapshotInfo(entry.meta, entry.tier)

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
            await self._tiers.run_io(trim_heap)

    def trim_buffer_pool(self) -> None:
        """Unmaps pooled buffers no put reused for buffer_pool_idle_s."""
        self._tiers.trim_pool(self.config.buffer_pool_idle_s)

    @property
    def buffer_pool(self) -> BufferPool:
        """For tests and diagnostics; CacheStats mirrors the proto, which has
        no pool fields."""
        return self._tiers.pool

    def stats(self) -> CacheStats:
        """Every counter as it stands, and the tiers' figures now."""
        tiers = self._tiers
        listed = list(tiers.entries())
        return CacheStats(
            **values(self._counters),
            num_evictions=tiers.num_evictions,
            num_spills=tiers.num_spills,
            memory_bytes=tiers.memory_used,
            memory_budget_bytes=self.config.memory_budget_bytes,
            memory_snapshots=sum(1 for e in listed if e.residence is not Residence.DISK),
            disk_bytes=tiers.disk_used,
            disk_budget_bytes=self.config.disk_budget_bytes,
            disk_snapshots=sum(1 for e in listed if e.residence is Residence.DISK),
            pinned_bytes=sum(e.size for e in listed if e.meta.pinned),
            reserved_bytes=tiers.reserved,
            free_bytes=tiers.memory_free() + tiers.disk_free(),
        )

    def check_integrity(self) -> None:
        """Raises AssertionError when the accounting disagrees with the entries
        or with the puts in progress."""
        self._tiers.check_integrity()
        assert not self._pending.keys() & {e.meta.snapshot_id for e in self._tiers.entries()}
