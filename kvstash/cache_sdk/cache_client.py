"""Async client of the KVCache service, used by the worker and the scheduler.

Callers only ever see kvstash.errors (`DataLoss` for a bad chunk, either
side), never grpc exceptions:

    async with CacheClient("127.0.0.1:50071") as cache:
        await cache.put("req-7", layout, num_blocks=4, num_tokens=60, data=host_buf,
                        timeout_s=remaining)
        header = await cache.get_into("req-7", memoryview(host_buf), consume=True)

Admission belongs to the cache: `put`'s defaults are its policy for a KV
snapshot, which a request waits for (a preempted one, or one handed off to a
decode instance): `pinned` (kept until read or deleted: spilled to disk under
pressure, never evicted) and `ttl_s` 0 (expired after the cache's own
--default-ttl without access, so the snapshots of a scheduler that died do
not stay forever). The worker's offloads take them as they are (worker.proto
Offload); only a writer that can afford to lose a snapshot passes
pinned=False, or a ttl_s of its own.

Deadlines belong to the caller: every call takes `timeout_s` (seconds for the
whole call, from the header to the last chunk), so a transfer made on behalf
of an RPC is bounded by that RPC's remaining time. A call given none gets the
client's `timeout_s`.

The co-located path: when the cache keeps its memory tier in an arena this
process can map (same host, same user), `put` and `get_into` move the bytes
through it (cache.proto PutShared/GetShared; kvstash.cache_sdk.arena_calls),
and `put_shared`/`get_shared` let a caller fill or read the extent itself (the
worker gathers KV blocks straight into it). Otherwise, and for snapshots
only on disk, they stream over gRPC (kvstash.cache_sdk.streamed_calls). This
class is the façade over both paths: it picks one, holds the channel, and
builds what both send (the header, each call's deadline), and makes again,
within its deadline, a call the cache refused before processing any of it
(kvstash.cache_sdk.refusals).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Self

from kvstash import errors
from kvstash.cache_sdk import refusals
from kvstash.cache_sdk.arena_calls import ArenaCalls, Lease, Write
from kvstash.cache_sdk.chunk_codec import DEFAULT_CHUNK_BYTES, check_chunk_bytes
from kvstash.cache_sdk.shared_arena import SharedArena, copy_hashed, copy_verified
from kvstash.cache_sdk.streamed_calls import StreamedCalls
from kvstash.common import rpc_connections
from kvstash.common.layout import Layout
from kvstash.common.rpc_connections import DEFAULT_TIMEOUT_S
from kvstash.common.security import PLAINTEXT, Security
from kvstash.common.wire import check_uint, layout_to_proto
from kvstash.v1 import cache_pb2, cache_pb2_grpc, common_pb2


class CacheClient:
    def __init__(
        self, address: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float | None = DEFAULT_TIMEOUT_S, use_arena: bool = True,
        security: Security = PLAINTEXT,
    ) -> None:
        """`timeout_s`: deadline of a call given none (None = no deadline).
        `use_arena`: take the co-located path when the cache's arena can be
        mapped. `security`: TLS (mutual, with a certificate) for the channel.
        Raises InvalidArgument (a ValueError) for a bad `chunk_bytes`."""
        check_chunk_bytes(chunk_bytes)
        self.address = address
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.use_arena = use_arena
        self._channel = rpc_connections.channel(address, security)
        self._stub = cache_pb2_grpc.KVCacheStub(self._channel)
        self._shared = ArenaCalls(self._stub, address)
        self._streamed = StreamedCalls(self._channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Ends every call: the cache quarantines the extent of an arena put
        still being written (cache_svc.arena_calls)."""
        await self._channel.close()
        self._shared.close()

    # -- the co-located path ----------------------------------------------------

    async def arena(self, timeout_s: float | None = None) -> SharedArena | None:
        """The cache's arena mapped here, or None where it has none or this
        process cannot map it (then `put`/`get_into` stream). Asked once, again
        after a shared call found the arena changed, and every minute while
        there is none mapped (the cache may restart with one)."""
        if not self.use_arena:
            return None
        return await self._shared.arena(self._timeout(timeout_s))

    async def put_shared(
        self, snapshot_id: str, layout: Layout, num_blocks: int, num_tokens: int,
        total_bytes: int, write: Write,
        pinned: bool = True, ttl_s: int = 0, timeout_s: float | None = None,
    ) -> int | None:
        """Puts through the arena: `write(extent, lease)` must fill all
        total_bytes of it, each copy after `lease.check()` (the call still
        holds the extent; see arena_calls.Lease), and may return the checksums of its
        chunks of `chunk_bytes` (else they are computed here); then the put is
        committed. Returns the bytes stored, or None where there is no arena
        to use (call `put`). The extent is leased to the call, so the call
        outlives `write`, even when cancelled."""
        header = self._header(snapshot_id, layout, num_blocks, num_tokens, total_bytes, pinned,
                              ttl_s)
        arena = await self.arena(timeout_s)
        if arena is None:
            return None
        return await refusals.retried(lambda left: self._shared.put(arena, header, write, left),
                                      self._timeout(timeout_s))

    async def get_shared(
        self, snapshot_id: str,
        read: Callable[[cache_pb2.SnapshotHeader, memoryview, list[int]], Awaitable[None]],
        consume: bool = False, timeout_s: float | None = None,
        verified_by_read: bool = False,
    ) -> cache_pb2.SnapshotHeader | None:
        """Gets through the arena: every chunk of the extent is verified, then
        `read(header, extent, checksums)` uses it (the snapshot stays in place
        until it returns; the call outlives it, as for `put_shared`). With
        `verified_by_read`, `read` verifies the chunks itself as it copies
        them. `consume` as for `get_into`, but only a `read` that returned
        counts. None where there is no arena, or the snapshot is only on disk
        (call `get_into`)."""
        arena = await self.arena(timeout_s)
        if arena is None:
            return None
        return await refusals.retried(
            lambda left: self._shared.get(arena, snapshot_id, read, consume, left,
                                          verified_by_read),
            self._timeout(timeout_s))

    def _header(
        self, snapshot_id: str, layout: Layout, num_blocks: int, num_tokens: int,
        total_bytes: int, pinned: bool, ttl_s: int,
    ) -> cache_pb2.SnapshotHeader:
        for name, value, bits in (("num_blocks", num_blocks, 32), ("num_tokens", num_tokens, 32),
                                  ("total_bytes", total_bytes, 64), ("ttl_s", ttl_s, 32)):
            check_uint(name, value, bits)
        return cache_pb2.SnapshotHeader(
            snapshot_id=snapshot_id, layout=layout_to_proto(layout), num_blocks=num_blocks,
            num_tokens=num_tokens, total_bytes=total_bytes, chunk_bytes=self.chunk_bytes,
            checksum_algorithm=cache_pb2.CHECKSUM_ALGORITHM_XXH3_64, pinned=pinned, ttl_s=ttl_s,
        )

    # -- puts and gets, through the arena or streamed ---------------------------

    async def put(
        self,
        snapshot_id: str,
        layout: Layout,
        num_blocks: int,
        num_tokens: int,
        data: object,
        pinned: bool = True,
        ttl_s: int = 0,
        timeout_s: float | None = None,
    ) -> int:
        """Stores the snapshot (through the arena if it can, else streamed);
        returns the bytes stored. `data` is any C-contiguous buffer (bytes,
        bytearray, memoryview, numpy array...). `timeout_s` bounds the whole
        put, waiting for room included."""
        view = memoryview(data).cast("B")  # type: ignore[arg-type]

        def copy(extent: memoryview, lease: Lease) -> list[int]:
            lease.check(f"put of {snapshot_id}")
            return copy_hashed(extent, view, self.chunk_bytes)

        async def fill(extent: memoryview, lease: Lease) -> list[int]:
            return await asyncio.to_thread(copy, extent, lease)

        stored = await self.put_shared(snapshot_id, layout, num_blocks, num_tokens, view.nbytes,
                                       fill, pinned, ttl_s, timeout_s)
        if stored is not None:
            return stored
        header = self._header(snapshot_id, layout, num_blocks, num_tokens, view.nbytes, pinned,
                              ttl_s)
        return await refusals.retried(lambda left: self._streamed.put(header, view, left),
                                      self._timeout(timeout_s))

    async def get_into(
        self, snapshot_id: str, out: memoryview, start_chunk: int = 0, consume: bool = False,
        timeout_s: float | None = None,
    ) -> cache_pb2.SnapshotHeader:
        """Reads the snapshot (from `start_chunk` on) into `out`, which must be
        writable and exactly total_bytes long; bytes before the start chunk
        are left as they are. Raises DataLoss on a bad chunk. With `consume`
        the cache deletes the snapshot once it has sent the last chunk (even
        if this then refuses it) or, through the arena, once it was copied
        out; a read that ends before that leaves it."""
        check_uint("start_chunk", start_chunk)
        target = memoryview(out).cast("B")
        if target.readonly:
            raise errors.InvalidArgument("get_into needs a writable buffer")

        def check_size(header: cache_pb2.SnapshotHeader) -> memoryview:
            if target.nbytes != header.total_bytes:
                raise errors.InvalidArgument(
                    f"buffer has {target.nbytes} bytes, snapshot {snapshot_id} has "
                    f"{header.total_bytes}"
                )
            return target

        async def copy_out(header: cache_pb2.SnapshotHeader, extent: memoryview,
                           checksums: list[int]) -> None:
            await asyncio.to_thread(copy_verified, check_size(header), extent,
                                    header.chunk_bytes, checksums, f"snapshot {snapshot_id}")

        if start_chunk == 0:
            header = await self.get_shared(snapshot_id, copy_out, consume, timeout_s,
                                           verified_by_read=True)
            if header is not None:
                return header
        return await refusals.retried(
            lambda left: self._streamed.read(snapshot_id, start_chunk, consume, left, check_size),
            self._timeout(timeout_s))

    async def get(
        self, snapshot_id: str, consume: bool = False, timeout_s: float | None = None
    ) -> tuple[cache_pb2.SnapshotHeader, bytes]:
        """The whole snapshot in a new buffer; `consume` as for `get_into`."""
        buffers: list[bytearray] = []

        def allocate(header: cache_pb2.SnapshotHeader) -> memoryview:
            buffers.append(bytearray(header.total_bytes))
            return memoryview(buffers[0])

        header = await refusals.retried(
            lambda left: self._streamed.read(snapshot_id, 0, consume, left, allocate),
            self._timeout(timeout_s))
        return header, bytes(buffers[0])

    async def delete(self, snapshot_id: str, timeout_s: float | None = None) -> None:
        request = cache_pb2.DeleteSnapshotRequest(snapshot_id=snapshot_id)
        await refusals.unary(lambda left: self._stub.DeleteSnapshot(request, timeout=left),
                             self._timeout(timeout_s))

    async def stat(
        self, snapshot_id: str, timeout_s: float | None = None
    ) -> cache_pb2.SnapshotInfo:
        request = cache_pb2.StatSnapshotRequest(snapshot_id=snapshot_id)
        return await refusals.unary(lambda left: self._stub.StatSnapshot(request, timeout=left),
                                    self._timeout(timeout_s))

    async def find(
        self, snapshot_ids: list[str], timeout_s: float | None = None
    ) -> list[int]:
        """Where each snapshot is stored (cache_pb2.Tier values, TIER_UNSPECIFIED:
        not stored), in the order asked."""
        request = cache_pb2.FindSnapshotsRequest(snapshot_ids=snapshot_ids)
        response = await refusals.unary(
            lambda left: self._stub.FindSnapshots(request, timeout=left), self._timeout(timeout_s))
        if len(response.tiers) != len(snapshot_ids):
            raise errors.DataLoss(f"cache answered {len(response.tiers)} tiers for "
                                  f"{len(snapshot_ids)} snapshot ids")
        return list(response.tiers)

    async def stats(self, timeout_s: float | None = None) -> cache_pb2.CacheStats:
        request = common_pb2.GetStatsRequest()
        return await refusals.unary(lambda left: self._stub.GetStats(request, timeout=left),
                                    self._timeout(timeout_s))

    def _timeout(self, timeout_s: float | None) -> float | None:
        """The deadline of one call: the caller's, else the client's."""
        return self.timeout_s if timeout_s is None else timeout_s
