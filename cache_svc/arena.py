"""The shared-memory arena: the memory tier as one file that co-located
workers map, so a snapshot's bytes move by memcpy (or DMA) instead of gRPC.

    <arena_dir>/kvstash-arena-<id>.shm     (mode 0600, exactly `size` bytes)
    |-- extent --|-- free --|---- extent ----|-- extent --|---- free ----|

The file is allocated whole when the cache starts (posix_fallocate), so the
memory tier's resident memory is the arena's size from the first second and
never more, and no write into it can fail for want of pages (a tmpfs that is
too small fails the start instead, with ENOSPC). Both sides map it populated,
so a copy never waits for page faults.

Extents are contiguous byte ranges, ALIGN-aligned, handed out best-fit from
a free list that coalesces neighbours. Who may touch an extent is the store's
business (a put holds its extent until commit or abort, a reader until it is
done); this module only allocates.

Ownership of the file: the cache holds an exclusive flock on it while it
lives. A cache that dies leaves the file behind; the next cache to start in
the same directory finds it unlocked and removes it (`remove_stale`), so a
crash loop cannot fill /dev/shm. A worker still mapping a removed arena keeps
its memory until it drops the mapping (kvstash.cache_sdk.shared_arena does once it
sees a new arena id).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import stat
from pathlib import Path

from kvstash.cache_sdk.shared_arena import (
    ARENA_FILE_PREFIX,
    ARENA_FILE_SUFFIX,
    arena_file_name,
    buffer_address,
)

log = logging.getLogger(__name__)

# Extent start and size granularity: a page, as a private mapping's, so the
# budget charges a snapshot the same either way (model.pages).
ALIGN = mmap.PAGESIZE


def remove_stale(directory: Path) -> int:
    """Removes this user's arena files whose cache is gone (nobody holds
    their lock); returns how many. Other users' files are left alone: in a
    shared directory like /dev/shm anyone may leave one under that name."""
    removed = 0
    for path in directory.glob(f"{ARENA_FILE_PREFIX}*{ARENA_FILE_SUFFIX}"):
        try:
            status = path.lstat()
        except FileNotFoundError:
            continue
        if status.st_uid != os.geteuid() or not stat.S_ISREG(status.st_mode):
            log.info("left %s alone: not a file of this user (uid %d, %s)", path,
                     status.st_uid, stat.filemode(status.st_mode))
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live cache owns it
        finally:
            os.close(fd)
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except PermissionError as exc:
            log.warning("cannot remove stale arena %s: %s", path, exc.strerror)
            continue
        log.info("removed stale arena %s", path.name)
        removed += 1
    return removed


def check_directory(directory: Path) -> None:
    """PermissionError unless `directory` is this user's or root's: its
    owner may rename or remove any file in it, sticky or not, and so could
    swap the arena for a file of their own. Others' write access is not
    refused: /dev/shm is sticky, and a Kubernetes emptyDir (0777) is seen
    only by its pod. A worker maps only a 0600 file of its own user
    (SharedArena), so others cannot plant one there either."""
    owner = directory.stat().st_uid
    if owner not in (os.geteuid(), 0):
        raise PermissionError(
            f"arena directory {directory} belongs to uid {owner}, who could swap the arena "
            f"file for one of their own: give --arena-dir a directory of uid {os.geteuid()}")


class Arena:
    def __init__(self, directory: Path, size: int) -> None:
        """Creates, allocates and maps a new arena of `size` bytes (rounded
        down to ALIGN). Raises OSError if the directory cannot hold it."""
        size -= size % ALIGN
        if size <= 0:
            raise ValueError(f"arena size must be at least {ALIGN} bytes")
        directory.mkdir(parents=True, exist_ok=True)
        check_directory(directory)
        remove_stale(directory)
        self.arena_id = secrets.token_hex(8)
        self.path = directory / arena_file_name(self.arena_id)
        self.size = size
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(self._fd, 0, size)
            self._map = mmap.mmap(self._fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError as exc:
            self._unlink()
            os.close(self._fd)
            free = os.statvfs(directory)
            raise OSError(exc.errno, (
                f"cannot allocate a {size}-byte arena in {directory}: {exc.strerror} "
                f"({free.f_bavail * free.f_frsize} bytes free there)")) from None
        self._base = buffer_address(self._map)
        self._view = memoryview(self._map)
        # Free ranges as parallel sorted lists of offsets and lengths.
        self._free_offsets: list[int] = [0]
        self._free_lengths: list[int] = [size]
        self.free_bytes = size

    def alloc(self, num_bytes: int) -> memoryview | None:
        """A writable view of a free extent of `num_bytes` (best fit), or None
        when no free range is large enough (which may be fragmentation)."""
        need = _aligned(num_bytes)
        best = -1
        for i, length in enumerate(self._free_lengths):
            if length >= need and (best < 0 or length < self._free_lengths[best]):
                best = i
        if best < 0:
            return None
        offset = self._free_offsets[best]
        if self._free_lengths[best] == need:
            del self._free_offsets[best], self._free_lengths[best]
        else:
            self._free_offsets[best] += need
            self._free_lengths[best] -= need
        self.free_bytes -= need
        return self._view[offset : offset + num_bytes]

    def free(self, extent: memoryview) -> None:
        """Returns an extent `alloc` handed out, merging it with free neighbours."""
        offset = self.offset_of(extent)
        length = _aligned(extent.nbytes)
        i = bisect.bisect(self._free_offsets, offset)
        if i > 0 and self._free_offsets[i - 1] + self._free_lengths[i - 1] > offset:
            raise ValueError(f"extent at {offset} is already free")
        self.free_bytes += length
        if i < len(self._free_offsets) and offset + length == self._free_offsets[i]:
            length += self._free_lengths[i]
            del self._free_offsets[i], self._free_lengths[i]
        if i > 0 and self._free_offsets[i - 1] + self._free_lengths[i - 1] == offset:
            self._free_lengths[i - 1] += length
        else:
            self._free_offsets.insert(i, offset)
            self._free_lengths.insert(i, length)

    def offset_of(self, extent: memoryview) -> int:
        """Where `extent`, a view `alloc` handed out, starts in the arena."""
        offset = buffer_address(extent) - self._base
        if not 0 <= offset < self.size:
            raise ValueError("not an extent of this arena")
        return offset

    def largest_free(self, also: list[memoryview] | None = None) -> int:
        """The longest free range, as it would be were the extents `also`
        (handed out, none twice) free too."""
        runs = self.runs()
        for extent in also or ():
            runs.free(extent)
        return runs.longest

    def runs(self) -> FreeRuns:
        """The free ranges, to ask what freeing more extents would make."""
        return FreeRuns(self)

    def close(self) -> None:
        """Removes the file; the mapping goes once the last view of it does."""
        self._unlink()
        self._view.release()
        with contextlib.suppress(BufferError):  # views still held at shutdown
            self._map.close()
        os.close(self._fd)

    def _unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def check_integrity(self, num_extent_bytes: int) -> None:
        """`num_extent_bytes`: bytes of the extents handed out, unaligned."""
        offsets, lengths = self._free_offsets, self._free_lengths
        assert offsets == sorted(offsets), offsets
        for i in range(1, len(offsets)):  # disjoint and not adjacent (merged)
            assert offsets[i - 1] + lengths[i - 1] < offsets[i], (offsets, lengths)
        assert self.free_bytes == sum(lengths), (self.free_bytes, lengths)
        assert self.size - self.free_bytes >= num_extent_bytes


class FreeRuns:
    """An arena's free ranges as they would be with more extents freed, each
    merged with its neighbours in O(1): eviction asks this victim by victim."""

    def __init__(self, arena: Arena) -> None:
        self._arena = arena
        self._end_of = {o: o + n for o, n in zip(arena._free_offsets, arena._free_lengths,
                                                 strict=True)}
        self._start_of = {end: start for start, end in self._end_of.items()}
        self.longest = max(arena._free_lengths, default=0)

    def free(self, extent: memoryview) -> None:
        """Counts `extent` (handed out, not counted before) as free."""
        start = self._arena.offset_of(extent)
        end = start + _aligned(extent.nbytes)
        if end in self._end_of:  # a run right after it
            end = self._end_of.pop(end)
            del self._start_of[end]
        if start in self._start_of:  # a run right before it
            start = self._start_of.pop(start)
            del self._end_of[start]
        self._end_of[start], self._start_of[end] = end, start
        self.longest = max(self.longest, end - start)


def _aligned(num_bytes: int) -> int:
    return max(ALIGN, -(-num_bytes // ALIGN) * ALIGN)
