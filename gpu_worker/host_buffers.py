"""A pool of host buffers for KV blocks on their way to or from the cache service.

A new pinned allocation is slow (about 0.5 s per GiB, and it stalls whichever
thread makes it), so buffers are allocated once and lent again. A buffer is
one flat tensor of `capacity` blocks, capacities are powers of two, and a loan
of n blocks gets the smallest free buffer that holds n (a new one only if none
does), seen as a contiguous [layers, 2, n, block_size, kv_heads, head_dim]
prefix:

    buffer of 8 blocks  [ b0 b1 b2 b3 b4 | . . . ]     loan of 5 blocks = the first 5
                          (per layer and k/v, as gather_blocks lays them out)

Returned buffers wait in the pool for the next loan; past `max_idle_bytes` the
largest idle ones are freed, so the pool's idle memory stays under that bound
however many loans went before. Thread-safe: each loan is one borrower's alone
until returned.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class HostBlocks:
    """A loan: `blocks` is the view to use; give the whole object back."""

    blocks: torch.Tensor  # [layers, 2, n, block_size, kv_heads, head_dim], contiguous
    buffer: torch.Tensor  # the pooled flat storage behind it
    capacity: int  # blocks the buffer holds


class HostBlockPool:
    def __init__(self, block_shape: tuple[int, int, int, int, int], dtype: torch.dtype,
                 pinned: bool, max_idle_bytes: int) -> None:
        """block_shape: (layers, 2, block_size, kv_heads, head_dim)."""
        if max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be >= 0, got {max_idle_bytes}")
        self.block_shape = block_shape
        self.dtype = dtype
        self.pinned = pinned
        self.max_idle_bytes = max_idle_bytes
        self.block_numel = 1
        for size in block_shape:
            self.block_numel *= size
        self._lock = threading.Lock()
        self._idle: list[HostBlocks] = []  # sorted by capacity, smallest first
        self.num_allocations = 0  # buffers ever allocated (tests and metrics)
        self.num_lent = 0

    @property
    def block_bytes(self) -> int:
        return self.block_numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.capacity for b in self._idle) * self.block_bytes

    def acquire(self, num_blocks: int) -> HostBlocks:
        """A buffer for `num_blocks` blocks; its contents are whatever was there."""
        if num_blocks < 1:
            raise ValueError(f"need at least 1 block, got {num_blocks}")
        with self._lock:
            found = next((i for i, b in enumerate(self._idle) if b.capacity >= num_blocks), None)
            loan = self._idle.pop(found) if found is not None else None
            if loan is not None:
                self.num_lent += 1
        if loan is None:
            # Outside the lock: a slow pinned allocation must not hold up returns.
            capacity = 1 << (num_blocks - 1).bit_length()
            buffer = torch.empty(capacity * self.block_numel, dtype=self.dtype,
                                 pin_memory=self.pinned)
            with self._lock:
                self.num_allocations += 1
                self.num_lent += 1
            loan = HostBlocks(buffer, buffer, capacity)
        layers, kv, block_size, heads, dim = self.block_shape
        view = loan.buffer[:num_blocks * self.block_numel].view(
            layers, kv, num_blocks, block_size, heads, dim)
        return HostBlocks(view, loan.buffer, loan.capacity)

    def release(self, loan: HostBlocks) -> None:
        """Takes a loan back. The caller must not touch `loan.blocks` afterwards
        (and any copy out of or into it must have finished)."""
        with self._lock:
            self.num_lent -= 1
            self._idle.append(HostBlocks(loan.buffer, loan.buffer, loan.capacity))
            self._idle.sort(key=lambda b: b.capacity)
            while sum(b.capacity for b in self._idle) * self.block_bytes > self.max_idle_bytes:
                self._idle.pop()  # the largest goes first: it pins the most memory

    @contextlib.contextmanager
    def lend(self, num_blocks: int) -> Iterator[torch.Tensor]:
        loan = self.acquire(num_blocks)
        try:
            yield loan.blocks
        finally:
            self.release(loan)
