"""gRPC edge of the cache: converts protos to domain types and back, paces
streams, and maps domain errors to status codes. No cache logic lives here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from cache_svc.config import CacheConfig
from cache_svc.limiter import BandwidthLimiter, ByteLimiter
from cache_svc.metrics import serve_metrics
from cache_svc.model import SnapshotInfo, TierName
from cache_svc.snapshot import CHECKSUM_XXH3_64, MAX_CHUNK_BYTES, SnapshotMeta
from cache_svc.store import SnapshotStore
from kvstash import errors, rpc
from kvstash.chunk_codec import (
    ADMITTED_KEY,
    RawChunk,
    decode_put_request,
    encode_chunk,
    encode_message,
)
from kvstash.layout import Layout
from kvstash.metrics import MetricsServer
from kvstash.v1 import cache_pb2, cache_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["KVCache"].full_name
_ALGORITHM_NAMES = {cache_pb2.CHECKSUM_ALGORITHM_XXH3_64: CHECKSUM_XXH3_64}
_ALGORITHM_CODES = {name: code for code, name in _ALGORITHM_NAMES.items()}
DRAIN_LIMIT_S = 5.0  # how long a failed put reads out a client still sending
_TIER_CODES = {TierName.MEMORY: cache_pb2.TIER_MEMORY, TierName.DISK: cache_pb2.TIER_DISK}


def meta_from_proto(header: cache_pb2.SnapshotHeader, default_ttl_s: int) -> SnapshotMeta:
    if header.checksum_algorithm not in _ALGORITHM_NAMES:
        raise errors.InvalidArgument(
            f"checksum algorithm {header.checksum_algorithm} unsupported; "
            f"use CHECKSUM_ALGORITHM_XXH3_64 ({cache_pb2.CHECKSUM_ALGORITHM_XXH3_64})"
        )
    return SnapshotMeta(
        snapshot_id=header.snapshot_id,
        layout=Layout.of(header.layout),
        num_blocks=header.num_blocks,
        num_tokens=header.num_tokens,
        total_bytes=header.total_bytes,
        chunk_bytes=header.chunk_bytes,
        pinned=header.pinned,
        ttl_s=header.ttl_s or default_ttl_s,
        checksum_algorithm=_ALGORITHM_NAMES[header.checksum_algorithm],
    )


def meta_to_proto(meta: SnapshotMeta) -> cache_pb2.SnapshotHeader:
    lay = meta.layout
    return cache_pb2.SnapshotHeader(
        snapshot_id=meta.snapshot_id,
        layout=common_pb2.KvLayout(
            num_layers=lay.num_layers, block_size=lay.block_size,
            num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, dtype=lay.dtype,
        ),
        num_blocks=meta.num_blocks,
        num_tokens=meta.num_tokens,
        total_bytes=meta.total_bytes,
        chunk_bytes=meta.chunk_bytes,
        checksum_algorithm=_ALGORITHM_CODES[meta.checksum_algorithm],
        pinned=meta.pinned,
        ttl_s=meta.ttl_s,
    )


def info_to_proto(info: SnapshotInfo) -> cache_pb2.SnapshotInfo:
    return cache_pb2.SnapshotInfo(
        header=meta_to_proto(info.meta), tier=_TIER_CODES[info.tier],
        num_chunks=info.meta.num_chunks,
    )


class CacheServicer(cache_pb2_grpc.KVCacheServicer):
    def __init__(
        self, store: SnapshotStore, limiter: ByteLimiter, bandwidth: BandwidthLimiter
    ) -> None:
        self._store = store
        self._limiter = limiter  # bounds bytes in flight
        self._bandwidth = bandwidth  # bounds bytes per second

    async def PutSnapshot(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        stream = _PutStream(aiter(request_iterator), context)
        try:
            info = await self._put(stream)
        except errors.KvstashError as exc:
            # The reservation is already released. Closing the call while the
            # client is still sending makes grpc report a bare INTERNAL on its
            # side, so read out (and drop) what it sends, briefly, first.
            await self._drain(stream)
            await rpc.abort_with(context, exc)
        return cache_pb2.PutSnapshotResponse(info=info_to_proto(info))

    async def _put(self, stream: _PutStream) -> SnapshotInfo:
        first = await stream.next()
        if first is None:
            raise errors.InvalidArgument("put stream is empty; the first message must be a header")
        if isinstance(first, RawChunk):
            raise errors.InvalidArgument(
                f"first message is chunk {first.index}; a put must start with a header"
            )
        meta = meta_from_proto(first, self._store.config.default_ttl_s)
        await self._store.reserve_put(meta)
        try:
            # Tells the client its room is reserved: CacheClient sends no
            # payload before this, so puts waiting for room hold no bytes in
            # gRPC's receive windows. Admitting before the buffer exists lets
            # the first chunks cross the network while the kernel faults the
            # buffer in (what arrives meanwhile stays in the flow-control
            # window, counted in CacheConfig's overhead).
            await stream.send_metadata(admitted=True)
            session = self._store.begin_put(meta)
        except BaseException:
            self._store.release_put(meta)
            raise
        committed = False
        try:
            while True:
                # Paced before the chunk leaves gRPC, so waiting buffers nothing.
                await self._bandwidth.take(session.next_chunk_bytes)
                # Pull the next chunk out of gRPC only when the in-flight budget
                # allows; until then HTTP/2 flow control holds the sender back.
                async with self._limiter.hold(meta.chunk_bytes):
                    request = await stream.next()
                    if request is None:
                        break
                    if not isinstance(request, RawChunk):
                        raise errors.InvalidArgument(
                            f"second header after {session.num_received} chunks; "
                            "a put has exactly one header"
                        )
                    # request.data is a view into gRPC's message: one copy,
                    # into the snapshot buffer, in accept().
                    self._store.count_bytes_in(request.data.nbytes)
                    session.accept(request.index, request.data, request.checksum)
                    del request
            info = self._store.commit_put(session)
            committed = True
            return info
        finally:
            if not committed:
                await self._store.abort_put(session)

    async def _drain(self, stream: _PutStream) -> None:
        # Unadmitted CacheClients half-close on seeing metadata without the
        # admission key, so a refusal costs them no payload and no wait.
        await stream.send_metadata(admitted=False)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DRAIN_LIMIT_S):
                while not stream.ended:
                    await self._bandwidth.take(MAX_CHUNK_BYTES)
                    async with self._limiter.hold(MAX_CHUNK_BYTES):
                        await stream.next()

    # Writes with context.write (not yield) so each send waits for gRPC.
    async def GetSnapshot(  # type: ignore[override]
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> None:
        store = self._store
        try:
            reader = await store.open_reader(request.snapshot_id, request.start_chunk)
        except errors.KvstashError as exc:
            await rpc.abort_with(context, exc)
        try:
            meta = reader.meta
            await context.write(cache_pb2.GetSnapshotResponse(header=meta_to_proto(meta)))
            for index in range(request.start_chunk, meta.num_chunks):
                start, end = meta.chunk_range(index)
                await self._bandwidth.take(end - start)
                # One chunk at a time, and write() returns only once gRPC took it,
                # so a slow reader slows this loop instead of growing a buffer.
                async with self._limiter.hold(meta.chunk_bytes):
                    try:
                        data, digest = await store.read_chunk(reader, index)
                    except errors.KvstashError as exc:
                        await rpc.abort_with(context, exc)
                    message = encode_chunk(index, data, digest)  # the one copy
                    del data
                    await context.write(message)
                    del message
        finally:
            store.close_reader(reader)

    @rpc.maps_errors
    async def DeleteSnapshot(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._store.delete(request.snapshot_id)
        return cache_pb2.DeleteSnapshotResponse()

    @rpc.maps_errors
    async def StatSnapshot(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return info_to_proto(self._store.stat(request.snapshot_id))

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return cache_pb2.CacheStats(**asdict(self._store.stats()))


class _PutStream:
    """The request side of one put, remembering what was already done."""

    def __init__(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        self._requests = requests
        self._context = context
        self._metadata_sent = False
        self.ended = False  # the client half-closed

    async def next(self) -> Any:
        request = await anext(self._requests, None)
        self.ended = request is None
        return request

    async def send_metadata(self, admitted: bool) -> None:
        if not self._metadata_sent:
            self._metadata_sent = True
            await self._context.send_initial_metadata(((ADMITTED_KEY, "1"),) if admitted else ())


def add_servicer(servicer: CacheServicer, server: grpc.aio.Server) -> None:
    """The generated add_KVCacheServicer_to_server, except that PutSnapshot and
    GetSnapshot move chunks in kvstash.chunk_codec's raw wire format (same bytes on
    the wire; one copy per chunk instead of protobuf's three)."""
    handlers = {
        "PutSnapshot": grpc.stream_unary_rpc_method_handler(
            servicer.PutSnapshot, request_deserializer=decode_put_request,
            response_serializer=cache_pb2.PutSnapshotResponse.SerializeToString,
        ),
        "GetSnapshot": grpc.unary_stream_rpc_method_handler(
            servicer.GetSnapshot, request_deserializer=cache_pb2.GetSnapshotRequest.FromString,
            response_serializer=encode_message,
        ),
        "DeleteSnapshot": grpc.unary_unary_rpc_method_handler(
            servicer.DeleteSnapshot,
            request_deserializer=cache_pb2.DeleteSnapshotRequest.FromString,
            response_serializer=cache_pb2.DeleteSnapshotResponse.SerializeToString,
        ),
        "StatSnapshot": grpc.unary_unary_rpc_method_handler(
            servicer.StatSnapshot,
            request_deserializer=cache_pb2.StatSnapshotRequest.FromString,
            response_serializer=cache_pb2.SnapshotInfo.SerializeToString,
        ),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats, request_deserializer=common_pb2.GetStatsRequest.FromString,
            response_serializer=cache_pb2.CacheStats.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


@dataclass(slots=True)
class CacheServer:
    """A running cache: the gRPC server plus what must be stopped with it."""

    server: grpc.aio.Server
    port: int
    store: SnapshotStore
    metrics: MetricsServer | None
    sweeper: asyncio.Task[None]

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Stops accepting calls; in-flight puts get `grace_s` to finish, after
        which they are cancelled and leave nothing behind."""
        await self.server.stop(grace_s)
        await self.close_store()

    async def close_store(self) -> None:
        self.sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.sweeper
        await self.store.close()
        if self.metrics is not None:
            self.metrics.stop()


async def create_cache_server(
    config: CacheConfig, address: str, clock: Callable[[], float] = time.monotonic
) -> tuple[grpc.aio.Server, int, CacheServer]:
    """Recovers the disk tier, then binds `address` (port 0 = any) and serves.
    `clock` times snapshot TTLs (tests pass a fake one to expire on demand)."""
    store = SnapshotStore(config, clock)
    await store.start()
    servicer = CacheServicer(store, ByteLimiter(config.max_inflight_bytes),
                             BandwidthLimiter(config.bandwidth_limit_bytes_per_s))
    server, port, _health = await rpc.create_server(
        address,
        [lambda s: add_servicer(servicer, s)],
        [SERVICE_NAME],
    )
    metrics = serve_metrics(store, config.metrics_port) if config.metrics_port else None
    sweeper = asyncio.ensure_future(store.run_sweeper())
    return server, port, CacheServer(server, port, store, metrics, sweeper)
