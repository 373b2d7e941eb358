"""gRPC edge of the cache: the KVCache servicer, its registration, and the
server that runs it. The edge converts protos to domain types and back, paces
streams, and maps domain errors to status codes; no cache logic lives here.

This module holds what the three kinds of call share: `CacheServicer` (the
small calls here; the streamed transfers in cache_svc.stream_calls, the
co-located path in cache_svc.arena_calls), the receive settings that bound
what gRPC buffers (`SERVER_OPTIONS`), and `create_cache_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from cache_svc.arena_calls import ArenaCalls
from cache_svc.config import MAX_STREAMS_PER_CONNECTION, STREAM_WINDOW_BYTES, CacheConfig
from cache_svc.convert import found_to_proto, info_to_proto, stats_to_proto
from cache_svc.limiter import BandwidthLimiter, ByteLimiter
from cache_svc.metrics import TransferMetrics, serve_metrics
from cache_svc.store import SnapshotStore
from cache_svc.stream_calls import StreamedCalls
from kvstash.cache_sdk.chunk_codec import MAX_CHUNK_BYTES, decode_put_request, encode_message
from kvstash.common import rpc_errors, rpc_server
from kvstash.common.metrics import MetricsServer
from kvstash.common.rpc_connections import DEFAULT_CONNECTIONS, Connections
from kvstash.common.security import PLAINTEXT, Security
from kvstash.v1 import cache_pb2, common_pb2

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["KVCache"].full_name
# The largest request message: a chunk and its framing (headers are far smaller).
MAX_REQUEST_BYTES = MAX_CHUNK_BYTES + 4096
# gRPC receive settings that keep CacheConfig's memory bound whatever a
# client sends. Measured with grpc 1.85: a stream takes in its initial window
# ("lookahead") before the servicer asks for a message, and with BDP probing
# on every stream's initial window grows with the link's bandwidth-delay
# product: 32 puts that sent payload before admission were then held whole
# by gRPC (2.1 GiB for a 256 MiB budget). cache_svc.put_stream has the rest.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    # Refused from the length prefix, before any of it is buffered.
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    # Without BDP probing frames stay 16 KiB; a chunk in one frame is cheaper.
    ("grpc.http2.max_frame_size", MAX_REQUEST_BYTES),
]


class CacheServicer(StreamedCalls, ArenaCalls):
    """The KVCache service. gRPC registers one object per service, so its RPCs
    are one class, written in three rooms: the streamed transfers
    (`StreamedCalls`), the co-located path (`ArenaCalls`), and here the small
    calls that map one-to-one onto the store."""

    def __init__(
        self, store: SnapshotStore, limiter: ByteLimiter, bandwidth: BandwidthLimiter,
        metrics: TransferMetrics,
    ) -> None:
        self._store = store
        self._limiter = limiter
        self._bandwidth = bandwidth
        self._metrics = metrics
        self._endings = set()

    @rpc_errors.maps_errors
    async def DeleteSnapshot(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._store.delete(request.snapshot_id)
        return cache_pb2.DeleteSnapshotResponse()

    @rpc_errors.maps_errors
    async def StatSnapshot(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return info_to_proto(self._store.stat(request.snapshot_id))

    @rpc_errors.maps_errors
    async def FindSnapshots(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return found_to_proto(self._store.find(list(request.snapshot_ids)))

    @rpc_errors.maps_errors
    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return stats_to_proto(self._store.stats())


def add_servicer(servicer: CacheServicer, server: grpc.aio.Server) -> None:
    """The generated add_KVCacheServicer_to_server, except that PutSnapshot and
    GetSnapshot move chunks in kvstash.cache_sdk.chunk_codec's raw wire format (same bytes on
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
        "FindSnapshots": grpc.unary_unary_rpc_method_handler(
            servicer.FindSnapshots,
            request_deserializer=cache_pb2.FindSnapshotsRequest.FromString,
            response_serializer=cache_pb2.FindSnapshotsResponse.SerializeToString,
        ),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats, request_deserializer=common_pb2.GetStatsRequest.FromString,
            response_serializer=cache_pb2.CacheStats.SerializeToString,
        ),
        "GetArena": grpc.unary_unary_rpc_method_handler(
            servicer.GetArena, request_deserializer=cache_pb2.GetArenaRequest.FromString,
            response_serializer=cache_pb2.ArenaInfo.SerializeToString,
        ),
        "PutShared": grpc.stream_stream_rpc_method_handler(
            servicer.PutShared, request_deserializer=cache_pb2.PutSharedRequest.FromString,
            response_serializer=cache_pb2.PutSharedResponse.SerializeToString,
        ),
        "GetShared": grpc.stream_stream_rpc_method_handler(
            servicer.GetShared, request_deserializer=cache_pb2.GetSharedRequest.FromString,
            response_serializer=cache_pb2.GetSharedResponse.SerializeToString,
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
    config: CacheConfig, address: str, clock: Callable[[], float] = time.monotonic,
    security: Security = PLAINTEXT, connections: Connections = DEFAULT_CONNECTIONS,
) -> tuple[grpc.aio.Server, int, CacheServer]:
    """Recovers the disk tier, then binds `address` (port 0 = any) and serves
    (TLS as `security` says, each connection as `connections` allows).
    `clock` times snapshot TTLs (tests pass a fake one to expire on demand)."""
    store = SnapshotStore(config, clock)
    transfers = TransferMetrics()
    servicer = CacheServicer(store, ByteLimiter(config.max_inflight_bytes),
                             BandwidthLimiter(config.bandwidth_limit_bytes_per_s), transfers)
    try:
        await store.start()
        server, port, _health = await rpc_server.create_server(
            address,
            [lambda s: add_servicer(servicer, s)],
            [SERVICE_NAME],
            options=SERVER_OPTIONS, maximum_concurrent_rpcs=config.max_concurrent_rpcs,
            security=security, connections=connections,
        )
    except BaseException:  # its disk tier another cache's, its port taken: the
        await store.close()  # store goes, its arena and its disk tier's lock with it
        raise
    metrics = None
    if config.metrics_port:
        try:
            metrics = serve_metrics(store, transfers, config.metrics_port, config.metrics_host)
        except BaseException:  # its port is taken: nothing started may outlive this
            await server.stop(None)
            await store.close()
            raise
    sweeper = asyncio.ensure_future(store.run_sweeper())
    return server, port, CacheServer(server, port, store, metrics, sweeper)
