"""Freed snapshot buffers kept for reuse by later puts of the same size.

A fresh buffer costs a put its page faults and the kernel's zeroing of every
page (see `ingest.allocate`); a pooled one is already resident and is simply
overwritten. KV snapshots of one deployment repeat a few sizes, so buffers are
pooled by exact size (a snapshot buffer is always exactly total_bytes long).

Mechanism only; cache_svc.memory_tier keeps the accounting: pooled bytes
count against the memory budget, and `Tiers` releases them before a put is
made to wait, refused, or served by spilling or evicting anything. Safety of
reuse rests on the put protocol: a snapshot is listed only after chunks
0..n-1, which cover every byte, were all copied in, so nothing of a buffer's
previous contents can be served. Nobody else holds a pooled buffer: an
entry's buffer is given back only once no reader, spill or put uses it.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
from collections.abc import Callable

from cache_svc.model import pages


class BufferPool:
    """Idle buffers, least recently given back first, at most `max_bytes` in
    all (their whole pages, as the memory budget counts them)."""

    def __init__(self, max_bytes: int,
                 unmap: Callable[[mmap.mmap], None] | None = None) -> None:
        """`unmap(buffer)` disposes of a buffer the pool lets go of (default:
        `close_now`; `MemoryTier` does it off the event loop)."""
        self.max_bytes = max_bytes
        self._dispose = unmap or close_now
        # (buffer, when it was given back) in the order they were given back.
        self._idle: collections.deque[tuple[mmap.mmap, float]] = collections.deque()
        self.num_bytes = 0  # bytes of all idle buffers
        self.num_reused = 0  # buffers handed out again instead of mapped afresh
        self.num_released = 0  # buffers unmapped after being pooled

    def take(self, size: int) -> mmap.mmap | None:
        """The most recently pooled idle buffer of exactly `size` bytes, if any."""
        for i in range(len(self._idle) - 1, -1, -1):
            buffer, _ = self._idle[i]
            if len(buffer) == size:
                del self._idle[i]
                self.num_bytes -= pages(size)
                self.num_reused += 1
                return buffer
        return None

    def give(self, buffer: mmap.mmap, now: float) -> None:
        """Pools `buffer`, releasing the oldest buffers to stay within
        max_bytes; a buffer bigger than max_bytes is released at once."""
        size = pages(len(buffer))
        if size > self.max_bytes:
            self._dispose(buffer)
            return
        self.release(self.num_bytes + size - self.max_bytes)
        self._idle.append((buffer, now))
        self.num_bytes += size

    def release(self, num_bytes: int) -> int:
        """Unmaps the oldest idle buffers until at least `num_bytes` are
        gone (or all are); returns how many bytes went."""
        released = 0
        while released < num_bytes and self._idle:
            buffer, _ = self._idle.popleft()
            released += self._unmap(buffer)
        return released

    def release_idle(self, older_than: float) -> int:
        """Unmaps buffers given back before `older_than`; returns the bytes."""
        released = 0
        while self._idle and self._idle[0][1] < older_than:
            buffer, _ = self._idle.popleft()
            released += self._unmap(buffer)
        return released

    def _unmap(self, buffer: mmap.mmap) -> int:
        size = pages(len(buffer))
        self.num_bytes -= size
        self.num_released += 1
        self._dispose(buffer)
        return size

    def check_integrity(self) -> None:
        assert self.num_bytes == sum(pages(len(b)) for b, _ in self._idle), self.num_bytes
        assert 0 <= self.num_bytes <= self.max_bytes, (self.num_bytes, self.max_bytes)


def close_now(buffer: mmap.mmap) -> None:
    """Unmaps `buffer` now rather than at garbage collection, so the room is
    real at once. A populating thread may still hold it for a few milliseconds
    (`ingest.populate`); then its last reference unmaps it."""
    with contextlib.suppress(BufferError):
        buffer.close()
