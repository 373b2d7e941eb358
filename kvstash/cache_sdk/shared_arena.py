"""The client's side of the co-located path: the cache's arena
(cache_svc.arena) mapped into this process, and the byte work around it.

gRPC carries only control (cache.proto PutShared/GetShared); the bytes move
here: a writer fills its extent and hashes every chunk; a reader verifies
every chunk before it uses a byte. Copies go through memmove with the GIL
released (as xxhash does), so the event loop keeps running while hundreds of
MiB move. A copy runs chunk by chunk on a small pool, one thread per core:
each thread hashes the chunk it has just copied, reading bytes still in the
CPU cache instead of memory, and the cores together copy faster than one.

The whole arena is mapped, populated, once per arena id (about 0.15 s per
GiB): a client on the cache's host, running as its user, can read and write
every extent, which is why readers verify and why the arena file is 0600.
It maps only a file named as the cache names an arena (`arena_file_name`),
so a cache cannot have it write into any other file, and only a 0600 file
of its own user, so nobody else can hand it one to fill with KV.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstash import errors
from kvstash.cache_sdk.chunk_codec import checksum
from kvstash.common.cpu import usable_cpus
from kvstash.v1 import cache_pb2

# Call-metadata key of a shared call: the arena id this client maps. A cache
# that restarted serves another arena and refuses the call with
# FAILED_PRECONDITION before it takes any room (cache_svc.arena_calls).
ARENA_ID_KEY = "kvstash-arena-id"
# An arena's file in the cache's --arena-dir: kvstash-arena-<arena id>.shm.
ARENA_FILE_PREFIX = "kvstash-arena-"
ARENA_FILE_SUFFIX = ".shm"

# Threads that copy and hash a shared call's chunks (bench.arena_bench's floor
# copies on as many).
COPY_THREADS = min(8, usable_cpus().num_cpus)
_hashers = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kv-hash")


def arena_file_name(arena_id: str) -> str:
    return f"{ARENA_FILE_PREFIX}{arena_id}{ARENA_FILE_SUFFIX}"


def chunk_checksums(view: memoryview, chunk_bytes: int) -> list[int]:
    """One checksum per chunk of `chunk_bytes` (the last may be shorter).
    Blocks; run it off the event loop."""
    starts = range(0, view.nbytes, chunk_bytes)
    return list(_hashers.map(lambda start: checksum(view[start : start + chunk_bytes]), starts))


def verify_chunks(view: memoryview, chunk_bytes: int, expected: list[int], what: str) -> None:
    """Raises DataLoss naming the first chunk whose bytes do not hash to
    `expected`. Blocks; run it off the event loop."""
    _check(chunk_checksums(view, chunk_bytes), expected, what)


def copy_hashed(dst: memoryview, src: memoryview, chunk_bytes: int) -> list[int]:
    """dst[:] = src; returns the checksums of its chunks. Blocks. Chunks are
    copied in parallel, each hashed by its copier right after its copy."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")

    def copy_one(start: int) -> int:
        piece = dst[start : start + chunk_bytes]
        copy_bytes(piece, src[start : start + chunk_bytes])
        return checksum(piece)

    return list(_hashers.map(copy_one, range(0, dst.nbytes, chunk_bytes)))


def copy_verified(dst: memoryview, src: memoryview, chunk_bytes: int, expected: list[int],
                  what: str) -> None:
    """dst[:] = src, verifying src's chunks against `expected` (DataLoss, and
    dst is not to be used, if one differs). Blocks."""
    if len(expected) != -(-src.nbytes // chunk_bytes):
        raise errors.DataLoss(f"{what}: {len(expected)} checksums for {src.nbytes} bytes "
                              f"in chunks of {chunk_bytes}")
    _check(copy_hashed(dst, src, chunk_bytes), expected, what)


def _check(actual: list[int], expected: list[int], what: str) -> None:
    if len(actual) != len(expected):
        raise errors.DataLoss(f"{what}: {len(expected)} checksums for {len(actual)} chunks")
    for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
        if got != want:
            raise errors.DataLoss(
                f"{what}: chunk {index} hashes to {got:#018x}, committed as {want:#018x}")


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src, with the GIL released when both are writable buffers."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
    if src.readonly:
        dst[:] = src
        return
    ctypes.memmove(buffer_address(dst), buffer_address(src), dst.nbytes)


def buffer_address(buffer: object) -> int:
    """Where a writable buffer's bytes start in this process's memory. The
    caller keeps `buffer` alive while it uses the address."""
    anchor = ctypes.c_char.from_buffer(buffer)  # type: ignore[arg-type]
    address = ctypes.addressof(anchor)
    del anchor
    return address


class SharedArena:
    def __init__(self, info: cache_pb2.ArenaInfo) -> None:
        """Maps the arena `info` names; OSError or ValueError when this process
        cannot (another host, another user, a file that is not that arena:
        misnamed, not regular, another user's, or open to others)."""
        self.arena_id = info.arena_id
        path = Path(info.path)
        if path.name != arena_file_name(info.arena_id):
            raise ValueError(f"{errors.preview(info.path)} is not a cache arena file "
                             f"(<arena dir>/{arena_file_name(info.arena_id)})")
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise ValueError(f"{info.path} is not a regular file")
            # Others can swap a file into a directory they own: the cache's is
            # 0600 and of this user (root maps a cache's of any user).
            euid = os.geteuid()
            if status.st_mode & 0o077 or euid not in (0, status.st_uid):
                raise ValueError(
                    f"{info.path} is not a cache arena file: {stat.filemode(status.st_mode)}, "
                    f"uid {status.st_uid} (an arena is 0600, of this process's uid {euid})")
            size = status.st_size
            if size != info.size_bytes:
                raise ValueError(f"{info.path} has {size} bytes, the cache's arena "
                                 f"{info.size_bytes}")
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)

    def view(self, extent: cache_pb2.Extent) -> memoryview:
        """The bytes of an extent the cache handed out for this arena."""
        if extent.arena_id != self.arena_id:
            raise errors.Unavailable(
                f"the cache's arena changed ({self.arena_id} -> {extent.arena_id}); retry")
        if extent.offset + extent.length > self._view.nbytes:
            raise errors.DataLoss(f"extent {extent.offset}+{extent.length} lies outside the "
                                  f"arena of {self._view.nbytes} bytes")
        return self._view[extent.offset : extent.offset + extent.length]

    def close(self) -> None:
        """Unmaps the arena once the last view of it is gone."""
        self._view.release()
        with contextlib.suppress(BufferError):
            self._map.close()
