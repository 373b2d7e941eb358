"""The read side of the store: gets over `Tiers`, counted in the store's
`Counters`. Plain asyncio and no gRPC.

A get is `open_reader`, `read_chunk` per chunk (or, through the arena, the
client reads the extent itself: `open_shared_reader`), then `close_reader`.
An open reader holds its snapshot busy: never spilled, evicted or expired
until it closes. Disk failures during a get are DataLoss or Unavailable
naming the snapshot and chunk. A consuming get deletes the snapshot when it
closes having read every chunk.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cache_svc.background import Background
from cache_svc.model import Counters, Entry
from cache_svc.snapshot import SnapshotMeta
from cache_svc.tiers import Tiers
from kvstash.common.ids import check_snapshot_id
from kvstash.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    KvstashError,
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


class Reads:
    """Opens, reads and closes gets; `SnapshotStore.reads`."""

    def __init__(self, tiers: Tiers, counters: Counters) -> None:
        self._tiers = tiers
        self._counters = counters  # the store's, shared with its puts

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
                fd = await self._open_file(path)
            except BaseException as exc:
                self.close_reader(Reader(entry, None))
                if isinstance(exc, OSError):
                    raise self._disk_failure(entry, path, start_chunk, exc) from exc
                raise
            return Reader(entry, fd, path, consume)
        return Reader(entry, None, consume=consume)

    async def _open_file(self, path: Path) -> int:
        """Opens `path` on an I/O thread. A get cancelled meanwhile cannot
        stop the thread, and would drop the descriptor it returns: that one
        is closed once the thread is done (by a task `Background.close`
        waits for, so even at shutdown)."""
        background, disk = self._tiers.background, self._tiers.disk
        assert disk is not None
        opening = asyncio.ensure_future(background.run_io(disk.open, path))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            background.spawn(_close_once_open(background, opening))
            raise

    async def open_shared_reader(self, snapshot_id: str, consume: bool) -> Reader:
        """`open_reader` for a client that reads the arena itself: the
        snapshot must be in memory (FailedPrecondition otherwise); it is
        counted as read out in full."""
        entry = self._tiers.lookup(check_snapshot_id(snapshot_id))
        if self._tiers.memory.arena is None or entry.buffer is None:
            raise FailedPrecondition(
                f"snapshot {preview(snapshot_id)} is not in the arena "
                f"({'on disk' if entry.buffer is None else 'this cache has none'}); "
                "read it with GetSnapshot"
            )
        reader = await self.open_reader(snapshot_id, consume=consume)
        self._counters.bytes_out += entry.meta.total_bytes
        self._counters.num_shared_gets += 1
        return reader

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
                data = await self._tiers.background.run_io(disk.read, reader.fd, start, end)
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
            background = tiers.background
            background.spawn(background.run_io(os.close, reader.fd))
            reader.fd = None
        if finished and reader.consume and tiers.lists(entry):
            tiers.drop(entry)
            self._counters.num_consumed += 1
        entry.num_readers -= 1
        tiers.settle(entry)
        tiers.background.notify()


async def _close_once_open(background: Background, opening: asyncio.Future[int]) -> None:
    """Closes the file `opening` opens, if it does."""
    try:
        fd = await opening
    except OSError:
        return
    await background.run_io(os.close, fd)
