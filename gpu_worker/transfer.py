"""Moving a request's KV blocks between the worker and the KV cache service.

Co-located with the cache (its arena can be mapped here; cache.proto PutShared):

    offload: blocks --gather (compute thread)--> the cache's arena extent, then commit
    restore: the cache's arena extent, verified --scatter (compute thread)--> blocks

On CUDA the arena is registered as pinned memory once, so those copies are
the DMA of the device link; nothing else moves the bytes. Otherwise, and for
snapshots the cache holds only on disk, through a pooled host buffer:

    offload: blocks --gather (compute thread)--> host buffer --put--> cache service
    restore: cache service --get_into--> host buffer --scatter (compute thread)--> blocks

Gathers and scatters run on the compute thread, between steps, so a copy never
overlaps a step that writes the same blocks. Streaming runs on the event loop,
so steps keep going while bytes move. Every cache call has a deadline, the
caller's (see `KvTransfer._bounded`): a stuck cache service fails the transfer
(UNAVAILABLE) and the scheduler falls back to recompute, instead of a request
waiting forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
import torch

from gpu_worker.host_buffers import HostBlocks
from gpu_worker.runner import ModelRunner
from kvstash import errors
from kvstash.cache_sdk.arena_calls import Lease, Write
from kvstash.common.layout import Layout
from kvstash.common.wire import layout_from_proto
from kvstash.v1 import cache_pb2

T = TypeVar("T")


class SnapshotClient(Protocol):
    """What the worker needs of `kvstash.cache_sdk.cache_client.CacheClient`: every
    call is bounded by the `timeout_s` it is given. Puts say nothing of how
    the cache keeps a snapshot: that is the cache's admission policy
    (CacheClient's defaults: kept until read or deleted, expired after the
    cache's --default-ttl), neither the worker's nor relayed through it."""

    async def put(self, snapshot_id: str, layout: Layout, num_blocks: int,
                  num_tokens: int, data: memoryview, *, pinned: bool = True,
                  timeout_s: float | None = None) -> int: ...

    async def get_into(self, snapshot_id: str, out: memoryview, start_chunk: int = 0,
                       consume: bool = False,
                       timeout_s: float | None = None) -> cache_pb2.SnapshotHeader: ...

    async def put_shared(self, snapshot_id: str, layout: Layout, num_blocks: int,
                         num_tokens: int, total_bytes: int,
                         write: Write, *,
                         pinned: bool = True, timeout_s: float | None = None) -> int | None: ...

    async def get_shared(
        self, snapshot_id: str,
        read: Callable[[cache_pb2.SnapshotHeader, memoryview, list[int]], Awaitable[None]],
        consume: bool = False, timeout_s: float | None = None,
    ) -> cache_pb2.SnapshotHeader | None: ...

    async def close(self) -> None: ...


def byte_view(host: torch.Tensor) -> memoryview:
    """The tensor's storage as flat bytes, shared, not copied (any dtype, bfloat16 too)."""
    return host.reshape(-1).view(torch.uint8).numpy().data


@dataclass(slots=True)
class KvTransfer:
    runner: ModelRunner
    compute: Executor  # the single thread that also runs steps
    cache: SnapshotClient | None  # None = no cache service configured

    def _cache(self, what: str) -> SnapshotClient:
        if self.cache is None:
            raise errors.FailedPrecondition(f"{what}: this worker has no cache service address")
        return self.cache

    async def _on_compute(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    async def _borrow(self, num_blocks: int) -> HostBlocks:
        """A loan from the host pool, taken on the compute thread (a new pinned
        buffer takes about 0.5 s per GiB, which the event loop must not wait).
        A caller cancelled meanwhile (its deadline, its client gone) gives the
        loan back once the thread has taken it."""
        pool = self.runner.host_pool
        taking = asyncio.get_running_loop().run_in_executor(self.compute, pool.acquire,
                                                            num_blocks)
        try:
            return await asyncio.shield(taking)
        except asyncio.CancelledError:
            def give_back(taken: asyncio.Future[HostBlocks]) -> None:
                if not taken.cancelled() and taken.exception() is None:
                    pool.release(taken.result())

            taking.add_done_callback(give_back)
            raise

    @staticmethod
    async def _bounded(call: Callable[[float], Awaitable[T]], deadline: float, what: str) -> T:
        """Runs `call(timeout_s)` with the time left until `deadline` (event-loop
        time). The client gets the same deadline, so the cache service stops
        when we do; the timeout also bounds a client that ignores it. It runs
        in this task, not under `wait_for`: cancelled twice (the timeout, then
        the RPC's own deadline), Python 3.11's `wait_for` stops waiting for its
        inner task, and a copy the client still makes into a host buffer
        would outlive the buffer's loan."""
        timeout_s = deadline - asyncio.get_running_loop().time()
        if timeout_s <= 0:
            raise errors.Unavailable(f"{what}: no time left for the cache service")
        try:
            async with asyncio.timeout(timeout_s):
                return await call(timeout_s)
        except TimeoutError:
            raise errors.Unavailable(
                f"{what}: cache service did not finish within {timeout_s:.2f} s"
            ) from None
        except grpc.RpcError as exc:  # the client should map these; never leak UNKNOWN
            raise errors.Unavailable(f"{what}: cache service call failed: {exc}") from None

    async def offload(self, snapshot_id: str, block_ids: Sequence[int], num_tokens: int,
                      deadline: float, shared_prefix: bool = False) -> int:
        """Returns the bytes the cache service committed. Until this returns the
        caller must not reuse the blocks (they may still be being read). The
        put must finish by `deadline` (event-loop time). A refusal raises the
        cache's own error unchanged (worker.proto Offload: nothing stored);
        no answer in time raises Unavailable (maybe stored). A `shared_prefix`
        segment is put unpinned, and one the cache already holds returns 0."""
        try:
            return await self._offload(snapshot_id, block_ids, num_tokens, deadline,
                                       pinned=not shared_prefix)
        except errors.AlreadyExists:
            if not shared_prefix:
                raise
            return 0

    async def _offload(self, snapshot_id: str, block_ids: Sequence[int], num_tokens: int,
                       deadline: float, *, pinned: bool) -> int:
        what = f"offload of snapshot {errors.preview(snapshot_id)}"
        cache = self._cache(what)
        capacity = len(block_ids) * self.runner.block_size
        if not 0 < num_tokens <= capacity:
            raise errors.InvalidArgument(
                f"{what}: num_tokens {num_tokens} must be in 1..{capacity} "
                f"({len(block_ids)} blocks of {self.runner.block_size})"
            )
        self.runner.check_copy_blocks(block_ids, what)  # before a buffer is sized by them
        layout = self.runner.layout
        pool = self.runner.host_pool
        num_blocks = len(block_ids)

        def gather(extent: memoryview, lease: Lease) -> None:
            lease.check(what)  # queued behind steps: the call may have ended meanwhile
            self.runner.gather_blocks_into(list(block_ids),
                                           self._pinned_blocks(extent, num_blocks))

        async def gather_into(extent: memoryview, lease: Lease) -> None:
            await self._on_compute(gather, extent, lease)  # hashed by the client

        stored = await self._bounded(
            lambda timeout_s: cache.put_shared(
                snapshot_id, layout, num_blocks, num_tokens, num_blocks * pool.block_bytes,
                gather_into, pinned=pinned, timeout_s=timeout_s),
            deadline, what,
        )
        if stored is not None:
            return stored
        loan = await self._borrow(num_blocks)
        try:
            await self._on_compute(self.runner.gather_blocks_into, list(block_ids), loan.blocks)
            return await self._bounded(
                lambda timeout_s: cache.put(snapshot_id, layout, len(block_ids), num_tokens,
                                            byte_view(loan.blocks), pinned=pinned,
                                            timeout_s=timeout_s),
                deadline, what,
            )
        finally:
            pool.release(loan)

    async def restore(self, snapshot_id: str, block_ids: Sequence[int], deadline: float,
                      keep: bool = False) -> int:
        """Reads the snapshot into `block_ids` (as many as it holds), consuming
        it unless `keep` (see worker.proto); returns its bytes. The read must
        finish by `deadline` (event-loop time)."""
        what = f"restore of snapshot {errors.preview(snapshot_id)} into {len(block_ids)} blocks"
        cache = self._cache(what)
        # Before the consuming read and before a buffer is sized by them.
        self.runner.check_copy_blocks(block_ids, what)
        pool = self.runner.host_pool
        num_blocks = len(block_ids)

        async def scatter_from(header: cache_pb2.SnapshotHeader, extent: memoryview,
                               checksums: list[int]) -> None:
            self.check_header(header, num_blocks, what)  # before a byte lands
            await self._on_compute(lambda: self.runner.scatter_blocks(
                list(block_ids), self._pinned_blocks(extent, num_blocks)))

        header = await self._bounded(
            lambda timeout_s: cache.get_shared(snapshot_id, scatter_from, consume=not keep,
                                               timeout_s=timeout_s),
            deadline, what,
        )
        if header is not None:
            return int(header.total_bytes)
        loan = await self._borrow(num_blocks)
        host = loan.blocks
        try:
            try:
                header = await self._bounded(
                    lambda timeout_s: cache.get_into(snapshot_id, byte_view(host), consume=not keep,
                                                     timeout_s=timeout_s),
                    deadline, what,
                )
            except errors.InvalidArgument as exc:  # e.g. the snapshot's size differs
                raise errors.InvalidArgument(f"{what}: {exc}") from None
            self.check_header(header, len(block_ids), what)
            await self._on_compute(self.runner.scatter_blocks, list(block_ids), host)
        finally:
            pool.release(loan)  # the scatter has read it (or never will)
        return host.numel() * host.element_size()

    def _pinned_blocks(self, extent: memoryview, num_blocks: int) -> torch.Tensor:
        """The extent as host blocks ([layers, 2, n, block_size, heads, dim]),
        sharing its memory; on CUDA the whole arena behind it is registered
        as pinned memory first (once), so copies to and from it are DMA.
        On the compute thread: a registration takes a while."""
        pool = self.runner.host_pool
        if extent.nbytes != num_blocks * pool.block_bytes:
            raise errors.DataLoss(f"extent has {extent.nbytes} bytes, {num_blocks} blocks "
                                  f"take {num_blocks * pool.block_bytes}")
        self.runner.pin_host_memory(extent.obj)
        layers, kv, block_size, heads, dim = pool.block_shape
        flat = torch.frombuffer(extent, dtype=torch.uint8).view(pool.dtype)
        return flat.view(layers, kv, num_blocks, block_size, heads, dim)

    def check_header(self, header: cache_pb2.SnapshotHeader, num_blocks: int, what: str) -> None:
        got, want = layout_from_proto(header.layout), self.runner.layout
        if got != want:
            raise errors.FailedPrecondition(
                f"{what}: snapshot layout ({got}) differs from this worker's ({want})")
        if header.num_blocks != num_blocks:
            raise errors.InvalidArgument(
                f"{what}: snapshot holds {header.num_blocks} blocks, request names {num_blocks}"
            )

