"""Disk tier files: atomic writes, chunk reads, and the rescan after a restart.

Every function here blocks; the store calls them in a thread executor.

One snapshot is one file `<id>~<token>.kvsnap` (the token makes names unique
even when an id is deleted and reused while a late write is still running):

    0        8          12               DATA_OFFSET     DATA_OFFSET+total
    | magic  | json len | json metadata  ... zero pad |  payload (row-major)  |
    DATA_OFFSET+total                       DATA_OFFSET+total+8*num_chunks
    | chunk 0 checksum | chunk 1 checksum | ... (u64 little-endian each)   |

The checksums are the ones verified when the snapshot was put; gets send
them as they are, so a byte damaged at rest fails the client's check instead
of being served. They trail the payload because the page-aligned head cannot
hold one per chunk of a large snapshot. Files of an older format (magic
KVSNAP01, without checksums) are unreadable and removed by `scan`.

A file is written under `.tmp~<id>~<token>`, fsynced, renamed into place and
the directory fsynced, so after a crash a name ending in `.kvsnap` always holds
a complete snapshot. Leftover temporaries are removed by `scan`. Ids are
validated before they get here and may not contain '~' or start with '.', so
neither kind of name can be produced by a client.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cache_svc.snapshot import SnapshotMeta
from kvstash.common.ids import check_snapshot_id
from kvstash.common.layout import Layout
from kvstash.common.units import MIB
from kvstash.errors import DataLoss, InvalidArgument

log = logging.getLogger(__name__)

MAGIC = b"KVSNAP02"
DATA_OFFSET = 4096  # page-aligned payload; the metadata is far smaller
CHECKSUM_BYTES = 8  # per chunk, in the trailer
MIN_FILE_BYTES = DATA_OFFSET + 1 + CHECKSUM_BYTES  # a snapshot of one byte
SUFFIX = ".kvsnap"
TMP_PREFIX = ".tmp~"
_WRITE_SLICE = 8 * MIB  # bytes per write call: bounds throttle granularity


@dataclass(frozen=True, slots=True)
class DiskSnapshot:
    """A complete snapshot file found by `scan`."""

    meta: SnapshotMeta
    path: Path
    checksums: tuple[int, ...]  # one per chunk, from the trailer
    idle_s: float  # since the file was last written, opened to be read or found (its mtime)


class DiskFiles:
    """Owns one directory; never follows a name it did not produce."""

    def __init__(self, directory: Path, write_bytes_per_s: float = 0.0) -> None:
        self.directory = directory
        # Test hook: a slow disk, so tests can watch writers wait on spills.
        self._write_bytes_per_s = write_bytes_per_s
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Creates the directory if needed and takes it for this cache alone
        (an exclusive flock on it, until `unlock` or the process ends). A
        second cache there would list this one's files, remove its spills in
        progress and evict or delete what it serves: OSError (EBUSY)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(errno.EBUSY, f"disk tier {self.directory} is in use by another "
                                       "cache: give each cache its own --disk-dir") from None
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def path_for(self, snapshot_id: str, token: str) -> Path:
        check_snapshot_id(snapshot_id)
        return self.directory / f"{snapshot_id}~{token}{SUFFIX}"

    def write(self, meta: SnapshotMeta, payload: memoryview, checksums: tuple[int, ...],
              wanted: Callable[[], bool] = lambda: True) -> Path | None:
        """Writes the snapshot and its chunk checksums atomically; returns its
        final path, or None if `wanted()`, asked once they are written, says
        no (nothing of them is left then)."""
        if len(checksums) != meta.num_chunks:
            raise ValueError(f"snapshot {meta.snapshot_id} has {meta.num_chunks} chunks, "
                             f"got {len(checksums)} checksums")
        token = secrets.token_hex(8)
        final = self.path_for(meta.snapshot_id, token)
        tmp = self.directory / f"{TMP_PREFIX}{meta.snapshot_id}~{token}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, _encode_head(meta))
            for start in range(0, len(payload), _WRITE_SLICE):
                piece = payload[start : start + _WRITE_SLICE]
                _write_all(fd, piece)
                if self._write_bytes_per_s:
                    time.sleep(len(piece) / self._write_bytes_per_s)
            _write_all(fd, _encode_trailer(checksums))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        if not wanted():
            os.unlink(tmp)
            return None
        try:
            os.rename(tmp, final)
        except BaseException:
            os.unlink(tmp)
            raise
        try:
            self._fsync_dir()
        except BaseException:  # not durable, so not written: nothing may come back at a scan
            os.unlink(final)
            raise
        return final

    def open(self, path: Path) -> int:
        """An fd to read the file; its mtime is set to now, so that a scan
        after a restart knows when it was last read (`DiskSnapshot.idle_s`)."""
        fd = os.open(path, os.O_RDONLY)
        with contextlib.suppress(OSError):  # a mark only: never fails a read
            os.utime(fd)
        return fd

    def touch(self, paths: list[Path]) -> None:
        """Sets the files' mtimes to now: they were used, if not read (see `open`)."""
        for path in paths:
            with contextlib.suppress(OSError):  # a mark only; the file may be gone
                os.utime(path)

    def read(self, fd: int, start: int, end: int) -> bytes:
        """Payload bytes [start, end) of an open snapshot file; DataLoss if the
        file is shorter (truncated since it was written)."""
        data = os.pread(fd, end - start, DATA_OFFSET + start)
        if len(data) != end - start:
            raise DataLoss(f"file is short: wanted {end - start} payload bytes at {start}, "
                           f"got {len(data)}")
        return data

    def remove(self, path: Path) -> None:
        """Unlinks the file; durably only after `sync_dir`."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def sync_dir(self) -> None:
        """Makes the unlinks done so far durable: a power loss brings none back."""
        try:
            self._fsync_dir()
        except OSError as exc:  # they are done, if maybe not durably: deletes still are
            log.warning("fsync of %s after unlinks failed: %s", self.directory, exc)

    def scan(self) -> list[DiskSnapshot]:
        """Creates the directory if needed, removes temporaries and unreadable
        files, and returns the complete snapshots, oldest first (newest file wins
        per id)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        found: dict[str, tuple[float, DiskSnapshot]] = {}
        for path in self.directory.iterdir():
            if path.name.startswith(TMP_PREFIX):
                log.info("removing leftover temporary %s", path.name)
                self.remove(path)
                continue
            if not path.name.endswith(SUFFIX) or not path.is_file():
                continue
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:
                continue
            snap = self._load(path, max(0.0, now - mtime))
            if snap is None:
                self.remove(path)
                continue
            previous = found.get(snap.meta.snapshot_id)
            if previous is None or previous[0] < mtime:
                if previous is not None:
                    self.remove(previous[1].path)
                found[snap.meta.snapshot_id] = (mtime, snap)
            else:
                self.remove(path)
        return [snap for _, snap in sorted(found.values(), key=lambda pair: pair[0])]

    def _load(self, path: Path, idle_s: float) -> DiskSnapshot | None:
        try:
            with open(path, "rb") as f:
                head = f.read(DATA_OFFSET)
                size = os.fstat(f.fileno()).st_size
                meta = _decode_head(head)
                expected = file_bytes(meta)
                if size != expected:
                    log.warning("removing %s: %d bytes, expected %d", path.name, size, expected)
                    return None
                trailer = os.pread(f.fileno(), expected - DATA_OFFSET - meta.total_bytes,
                                   DATA_OFFSET + meta.total_bytes)
            checksums = _decode_trailer(trailer, meta.num_chunks)
        except (OSError, ValueError, KeyError, TypeError, InvalidArgument) as exc:
            log.warning("removing unreadable snapshot file %s: %s", path.name, exc)
            return None
        if not path.name.startswith(meta.snapshot_id + "~"):
            log.warning("removing %s: it holds snapshot %r", path.name, meta.snapshot_id)
            return None
        return DiskSnapshot(meta, path, checksums, idle_s)

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _encode_head(meta: SnapshotMeta) -> bytes:
    body = json.dumps(asdict(meta), sort_keys=True).encode()
    head = MAGIC + struct.pack("<I", len(body)) + body
    if len(head) > DATA_OFFSET:
        raise ValueError(f"snapshot metadata is {len(head)} bytes, at most {DATA_OFFSET}")
    return head.ljust(DATA_OFFSET, b"\0")


def _decode_head(head: bytes) -> SnapshotMeta:
    if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
        raise ValueError(f"bad magic {head[: len(MAGIC)]!r}, expected {MAGIC!r}")
    (length,) = struct.unpack_from("<I", head, len(MAGIC))
    fields = json.loads(head[len(MAGIC) + 4 : len(MAGIC) + 4 + length])
    fields["layout"] = Layout(**fields["layout"])
    return SnapshotMeta(**fields)


def file_bytes(meta: SnapshotMeta) -> int:
    """The size of a snapshot's file: head, payload and checksum trailer."""
    return DATA_OFFSET + meta.total_bytes + CHECKSUM_BYTES * meta.num_chunks


def _encode_trailer(checksums: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(checksums)}Q", *checksums)


def _decode_trailer(trailer: bytes, num_chunks: int) -> tuple[int, ...]:
    if len(trailer) != CHECKSUM_BYTES * num_chunks:
        raise ValueError(f"checksum trailer has {len(trailer)} bytes, expected "
                         f"{CHECKSUM_BYTES * num_chunks}")
    return struct.unpack(f"<{num_chunks}Q", trailer)
