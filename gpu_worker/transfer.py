"""Moving a request's KV blocks between the worker and the KV cache service.

    offload: blocks --gather (compute thread)--> host buffer --put--> cache service
    restore: cache service --get_into--> host buffer --scatter (compute thread)--> blocks

Gathers and scatters run on the compute thread, between steps, so a copy never
overlaps a step that writes the same blocks. Streaming runs on the event loop,
so steps keep going while bytes move. Every cache call has a deadline: a stuck
cache service fails the transfer (UNAVAILABLE) and the scheduler falls back to
recompute, instead of a request waiting forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
import torch

from gpu_worker.runner import KvLayoutSpec, ModelRunner
from kvstash import errors
from kvstash.v1 import cache_pb2, common_pb2

T = TypeVar("T")


class SnapshotStore(Protocol):
    """What the worker needs of `kvstash.cache_client.CacheClient`."""

    async def put(self, snapshot_id: str, layout: common_pb2.KvLayout, num_blocks: int,
                  num_tokens: int, data: memoryview, pinned: bool = True,
                  ttl_s: int = 0) -> int: ...

    async def get_into(self, snapshot_id: str, out: memoryview) -> cache_pb2.SnapshotHeader: ...

    async def close(self) -> None: ...


def layout_proto(spec: KvLayoutSpec) -> common_pb2.KvLayout:
    return common_pb2.KvLayout(num_layers=spec.num_layers, block_size=spec.block_size,
                               num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                               dtype=spec.dtype)


def byte_view(host: torch.Tensor) -> memoryview:
    """The tensor's storage as flat bytes, shared, not copied (any dtype, bfloat16 too)."""
    return host.reshape(-1).view(torch.uint8).numpy().data


@dataclass(slots=True)
class KvTransfer:
    runner: ModelRunner
    compute: Executor  # the single thread that also runs steps
    store: SnapshotStore | None  # None = no cache service configured
    timeout_s: float

    def _store(self, what: str) -> SnapshotStore:
        if self.store is None:
            raise errors.FailedPrecondition(f"{what}: this worker has no cache service address")
        return self.store

    async def _on_compute(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    async def _bounded(self, call: Awaitable[T], what: str) -> T:
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError:
            raise errors.Unavailable(
                f"{what}: cache service did not finish within {self.timeout_s:g} s"
            ) from None
        except grpc.RpcError as exc:  # the client should map these; never leak UNKNOWN
            raise errors.Unavailable(f"{what}: cache service call failed: {exc}") from None

    async def offload(self, snapshot_id: str, block_ids: Sequence[int], num_tokens: int,
                      pinned: bool, ttl_s: int) -> int:
        """Returns the bytes the cache service committed. Until this returns the
        caller must not reuse the blocks (they may still be being read)."""
        what = f"offload of snapshot {errors.preview(snapshot_id)}"
        store = self._store(what)
        capacity = len(block_ids) * self.runner.block_size
        if not 0 < num_tokens <= capacity:
            raise errors.InvalidArgument(
                f"{what}: num_tokens {num_tokens} must be in 1..{capacity} "
                f"({len(block_ids)} blocks of {self.runner.block_size})"
            )
        host: torch.Tensor = await self._on_compute(self.runner.gather_blocks, list(block_ids))
        layout = layout_proto(self.runner.layout)
        return await self._bounded(
            store.put(snapshot_id, layout, len(block_ids), num_tokens, byte_view(host),
                      pinned=pinned, ttl_s=ttl_s),
            what,
        )

    async def restore(self, snapshot_id: str, block_ids: Sequence[int]) -> int:
        """Reads the snapshot into `block_ids` (as many as it holds); returns its bytes."""
        what = f"restore of snapshot {errors.preview(snapshot_id)} into {len(block_ids)} blocks"
        store = self._store(what)
        if not block_ids:
            raise errors.InvalidArgument(f"{what}: no destination block ids")
        self.runner.check_block_ids(block_ids, what)
        host = self.runner.empty_host_blocks(len(block_ids))
        try:
            header = await self._bounded(store.get_into(snapshot_id, byte_view(host)), what)
        except errors.InvalidArgument as exc:  # e.g. the snapshot's size differs
            raise errors.InvalidArgument(f"{what}: {exc}") from None
        self.check_header(header, len(block_ids), what)
        await self._on_compute(self.runner.scatter_blocks, list(block_ids), host)
        return host.numel() * host.element_size()

    def check_header(self, header: cache_pb2.SnapshotHeader, num_blocks: int, what: str) -> None:
        want = layout_proto(self.runner.layout)
        if header.layout != want:
            raise errors.FailedPrecondition(
                f"{what}: snapshot layout ({_describe(header.layout)}) differs from this "
                f"worker's ({_describe(want)})"
            )
        if header.num_blocks != num_blocks:
            raise errors.InvalidArgument(
                f"{what}: snapshot holds {header.num_blocks} blocks, request names {num_blocks}"
            )


def _describe(layout: common_pb2.KvLayout) -> str:
    return (f"{layout.num_layers} layers, block_size {layout.block_size}, "
            f"{layout.num_kv_heads} kv heads, head_dim {layout.head_dim}, {layout.dtype}")
