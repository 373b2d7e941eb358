"""Assembling one put: chunks are checked and copied into a preallocated buffer.

The buffer is an anonymous mmap of exactly total_bytes, so its pages go back
to the OS the moment it is dropped (a large malloc'd bytearray could linger in
the heap and inflate resident memory after a failed put).
"""

from __future__ import annotations

import mmap

from cache_svc.snapshot import ChecksumMismatch, SnapshotMeta, checksum
from kvstash.errors import InvalidArgument


def allocate(total_bytes: int) -> mmap.mmap:
    """Blocks (the kernel zeroes every page up front): call it off the event loop.

    MAP_POPULATE faults the pages in with one call, about twice as fast as
    taking 65536 page faults chunk by chunk for 256 MiB, which was most of a
    put's time. The reservation already counts every byte, so resident memory
    stays within the budget."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, total_bytes, flags=flags)


class PutSession:
    """Accepts chunks 0..n-1 strictly in order; any deviation raises, naming
    the chunk and why. The store owns the reservation; this owns the bytes."""

    __slots__ = ("buffer", "checksums", "meta", "num_received")

    def __init__(self, meta: SnapshotMeta, buffer: mmap.mmap) -> None:
        self.meta = meta
        self.buffer = buffer
        self.num_received = 0  # chunks accepted so far; also the next expected index
        self.checksums: list[int] = []  # of the chunks accepted, verified; gets reuse them

    @property
    def next_chunk_bytes(self) -> int:
        """Payload size of the chunk expected next; 0 once all arrived."""
        if self.num_received >= self.meta.num_chunks:
            return 0
        start, end = self.meta.chunk_range(self.num_received)
        return end - start

    def accept(self, index: int, data: bytes | memoryview, sent_checksum: int) -> None:
        meta = self.meta
        expected = self.num_received
        if index >= meta.num_chunks:
            raise InvalidArgument(
                f"chunk {index} is extra: snapshot {meta.snapshot_id} has {meta.num_chunks} "
                f"chunks (0..{meta.num_chunks - 1})"
            )
        if index < expected:
            raise InvalidArgument(f"chunk {index} is a duplicate: expected chunk {expected} next")
        if index > expected:
            raise InvalidArgument(
                f"chunk {index} is out of order: expected chunk {expected} next "
                "(chunks must arrive in order 0..n-1)"
            )
        start, end = meta.chunk_range(index)
        size = memoryview(data).nbytes
        if size != end - start:
            raise InvalidArgument(
                f"chunk {index} has {size} bytes, expected {end - start} "
                f"(chunk_bytes {meta.chunk_bytes}, total_bytes {meta.total_bytes})"
            )
        actual = checksum(data)
        if actual != sent_checksum:
            raise ChecksumMismatch(
                f"chunk {index} checksum mismatch: sent {sent_checksum:#018x}, "
                f"data hashes to {actual:#018x}"
            )
        self.buffer[start:end] = data
        self.checksums.append(actual)
        self.num_received += 1

    def check_complete(self) -> None:
        if self.num_received != self.meta.num_chunks:
            raise InvalidArgument(
                f"stream ended after {self.num_received} of {self.meta.num_chunks} chunks: "
                f"chunk {self.num_received} is missing"
            )
