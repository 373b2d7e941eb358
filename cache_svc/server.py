"""gRPC edge of the cache: converts protos to domain types and back, paces
streams, and maps domain errors to status codes. No cache logic lives here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from cache_svc.arena import Arena
from cache_svc.config import MAX_STREAMS_PER_CONNECTION, STREAM_WINDOW_BYTES, CacheConfig
from cache_svc.convert import info_to_proto, meta_from_proto, meta_to_proto, stats_to_proto
from cache_svc.limiter import BandwidthLimiter, ByteLimiter
from cache_svc.metrics import TransferMetrics, serve_metrics
from cache_svc.model import Buffer, SnapshotInfo
from cache_svc.put_stream import DRAIN_SHARE_BYTES, PutStream, put_share_bytes
from cache_svc.store import SnapshotStore
from kvstash import errors
from kvstash.cache_sdk.chunk_codec import (
    MAX_CHUNK_BYTES,
    RawChunk,
    decode_put_request,
    encode_chunk,
    encode_message,
)
from kvstash.common import rpc_errors, rpc_server
from kvstash.common.metrics import MetricsServer
from kvstash.common.rpc_connections import DEFAULT_CONNECTIONS, Connections
from kvstash.common.security import PLAINTEXT, Security
from kvstash.v1 import cache_pb2, cache_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["KVCache"].full_name
DRAIN_LIMIT_S = 5.0  # how long a failed put reads out a client still sending
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


async def _end_call(context: grpc.aio.ServicerContext, exc: errors.KvstashError) -> None:
    """Sends `exc`'s status from outside the call's handler."""
    with contextlib.suppress(Exception):  # grpc's AbortError once sent; or it had ended
        await rpc_errors.abort_with(context, exc)


class CacheServicer(cache_pb2_grpc.KVCacheServicer):
    def __init__(
        self, store: SnapshotStore, limiter: ByteLimiter, bandwidth: BandwidthLimiter,
        metrics: TransferMetrics,
    ) -> None:
        self._store = store
        self._limiter = limiter  # bounds bytes in flight
        self._bandwidth = bandwidth  # bounds bytes per second
        self._metrics = metrics
        self._endings: set[asyncio.Future[None]] = set()  # see _taken_within

    @rpc_errors.maps_errors
    async def PutSnapshot(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        stream = PutStream(aiter(request_iterator), context, self._limiter, self._bandwidth,
                           self._store.config.put_idle_s)
        try:
            info = await self._put(stream)
        except errors.KvstashError as exc:
            # The reservation is already released. Closing the call while the
            # client is still sending makes grpc report a bare INTERNAL on its
            # side, so read out (and drop) what it sends, briefly, first; the
            # refused chunk, still a local of _put's frame, goes before that.
            traceback.clear_frames(exc.__traceback__)
            await self._drain(stream)
            await rpc_errors.abort_with(context, exc)
        finally:
            await stream.close()
        self._metrics.put_seconds.observe(time.perf_counter() - started)
        return cache_pb2.PutSnapshotResponse(info=info_to_proto(info))

    async def _put(self, stream: PutStream) -> SnapshotInfo:
        first = await stream.next()
        if first is None:
            raise errors.InvalidArgument("put stream is empty; the first message must be a header")
        if isinstance(first, RawChunk):
            raise errors.InvalidArgument(
                f"first message is chunk {first.index}; a put must start with a header"
            )
        meta = meta_from_proto(first, self._store.config.default_ttl_s)
        # No payload is asked for before admission: however much the client
        # sends meanwhile, gRPC holds no more than the stream's initial window.
        await self._store.reserve_put(meta)
        try:
            await stream.hold(put_share_bytes(meta))
            # Tells the client its room is reserved (see cache.proto). Admitting
            # before the buffer exists lets the first chunks cross the network
            # while the kernel faults the buffer in.
            await stream.send_metadata(admitted=True)
            session = self._store.begin_put(meta)
        except BaseException:
            self._store.release_put(meta)
            raise
        committed = False
        try:
            await stream.read_ahead(session.next_chunk_bytes)
            while (request := await stream.take()) is not None:
                if not isinstance(request, RawChunk):
                    raise errors.InvalidArgument(
                        f"second header after {session.num_received} chunks; "
                        "a put has exactly one header"
                    )
                # Before asking for more: the put's share of the in-flight
                # budget only covers chunks of the sizes its header declared.
                session.check_next(request.index, request.data.nbytes)
                # The next chunk crosses the network while this one is copied.
                await stream.read_ahead(meta.chunk_size(session.num_received + 1))
                # request.data is a view into gRPC's message: one copy, into
                # the snapshot buffer, in accept().
                self._store.count_bytes_in(request.data.nbytes)
                session.accept(request.index, request.data, request.checksum)
                del request  # not kept while the next one is awaited
            info = self._store.commit_put(session)
            committed = True
            return info
        finally:
            if not committed:
                await self._store.abort_put(session)

    async def _drain(self, stream: PutStream) -> None:
        # Unadmitted CacheClients half-close on seeing metadata without the
        # admission key, so a refusal costs them no payload and no wait.
        await stream.send_metadata(admitted=False)
        # A client that went silent is done with too (PutStream's idle limit).
        with contextlib.suppress(TimeoutError, errors.DeadlineExceeded):
            async with asyncio.timeout(DRAIN_LIMIT_S):
                # A put admitted with a small share may now send chunks of
                # any size gRPC accepts.
                await stream.hold(DRAIN_SHARE_BYTES)
                while not stream.ended:
                    if not stream.reading:
                        await stream.read_ahead(MAX_CHUNK_BYTES)
                    await stream.take()

    # An async generator, the handler shape grpc's interceptors (tracing's
    # among them) support. grpc awaits each send before asking for the next
    # message, so a slow reader slows this loop instead of growing a buffer.
    @rpc_errors.maps_errors
    async def GetSnapshot(  # type: ignore[override]
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        started = time.perf_counter()
        store = self._store
        try:
            reader = await store.open_reader(request.snapshot_id, request.start_chunk,
                                             request.consume)
        except errors.KvstashError as exc:
            await rpc_errors.abort_with(context, exc)
        # Set only once the last chunk's send is done: a get that ends earlier
        # (the client cancels, a read fails) does not consume the snapshot.
        finished = False
        what = f"get of {errors.preview(request.snapshot_id)}"
        try:
            meta = reader.meta
            with self._taken_within(context, what):
                yield cache_pb2.GetSnapshotResponse(header=meta_to_proto(meta))
            for index in range(request.start_chunk, meta.num_chunks):
                start, end = meta.chunk_range(index)
                await self._bandwidth.take(end - start)
                async with self._limiter.hold(meta.chunk_bytes):
                    try:
                        data, digest = await store.read_chunk(reader, index)
                    except errors.KvstashError as exc:
                        await rpc_errors.abort_with(context, exc)
                    message = encode_chunk(index, data, digest)  # the one copy
                    del data
                    with self._taken_within(context, what):
                        yield message
                    del message
            finished = True
        finally:
            store.close_reader(reader, finished)
        self._metrics.get_seconds.observe(time.perf_counter() - started)

    @contextlib.contextmanager
    def _taken_within(self, context: grpc.aio.ServicerContext, what: str) -> Iterator[None]:
        """Ends the call unless its client takes the message yielded inside
        within get_idle_s. grpc awaits a send until the client's flow control
        lets it go, so a reader that stops reading would otherwise hold its
        share of the in-flight budget, and its snapshot, for good."""
        idle_s = self._store.config.get_idle_s
        task = asyncio.current_task()
        assert task is not None

        def give_up() -> None:
            exc = errors.DeadlineExceeded(f"{what}: the client took no message for {idle_s:g} s")
            log.warning("%s; ending the call", exc)
            # The status waits behind the unsent message, for a client that
            # reads again; cancelling the handler lets go of the rest now.
            ending = asyncio.ensure_future(_end_call(context, exc))
            self._endings.add(ending)
            ending.add_done_callback(self._endings.discard)
            task.cancel()

        timer = asyncio.get_running_loop().call_later(idle_s, give_up)
        try:
            yield
        finally:
            timer.cancel()

    # -- the co-located path (see cache.proto and cache_svc.arena) --------------

    @rpc_errors.maps_errors
    async def GetArena(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        arena = self._store.arena
        if arena is None:
            return cache_pb2.ArenaInfo()
        return cache_pb2.ArenaInfo(path=str(arena.path), size_bytes=arena.size,
                                   arena_id=arena.arena_id)

    @rpc_errors.maps_errors
    async def PutShared(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        started = time.perf_counter()
        store = self._store
        requests = aiter(request_iterator)
        try:
            # The first message is read before anything is refused: a client
            # whose write of it met a call already ended would learn only
            # grpc's internal error, not why.
            header = await self._expect(requests, "header", "shared put")
            arena = self._arena()
            meta = meta_from_proto(header, store.config.default_ttl_s)
            await store.reserve_put(meta)
        except errors.KvstashError as exc:
            await rpc_errors.abort_with(context, exc)
        try:
            session = store.begin_put(meta)
        except BaseException:
            store.release_put(meta)
            raise
        committed = False
        try:
            yield cache_pb2.PutSharedResponse(extent=self._extent(arena, session.buffer))
            commit = await self._expect(requests, "commit",
                                        f"put of {errors.preview(meta.snapshot_id)}", lease=True)
            info = store.commit_shared_put(session, list(commit.checksums))
            committed = True
            yield cache_pb2.PutSharedResponse(info=info_to_proto(info))
        except errors.KvstashError as exc:
            await rpc_errors.abort_with(context, exc)
        finally:
            if not committed:  # the client failed, left, or ran out of lease
                await store.abort_put(session)
        self._metrics.put_seconds.observe(time.perf_counter() - started)

    @rpc_errors.maps_errors
    async def GetShared(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        started = time.perf_counter()
        store = self._store
        requests = aiter(request_iterator)
        try:
            request = await self._expect(requests, "open", "shared get")  # as in PutShared
            arena = self._arena()
            if request.start_chunk:
                raise errors.InvalidArgument("a shared get reads the whole snapshot: "
                                             f"start_chunk is {request.start_chunk}, must be 0")
            reader = await store.open_shared_reader(request.snapshot_id, request.consume)
        except errors.KvstashError as exc:
            await rpc_errors.abort_with(context, exc)
        finished = False
        try:
            entry = reader.entry
            assert entry.buffer is not None
            yield cache_pb2.GetSharedResponse(header=meta_to_proto(reader.meta),
                                              extent=self._extent(arena, entry.buffer),
                                              checksums=entry.checksums)
            await self._expect(requests, "done",
                               f"get of {errors.preview(reader.meta.snapshot_id)}", lease=True)
            finished = True
        except errors.KvstashError as exc:
            await rpc_errors.abort_with(context, exc)
        finally:
            store.close_reader(reader, finished)
        self._metrics.get_seconds.observe(time.perf_counter() - started)

    def _arena(self) -> Arena:
        arena = self._store.arena
        if arena is None:
            raise errors.FailedPrecondition(
                "this cache has no arena (start it with --arena-dir); use PutSnapshot and "
                "GetSnapshot")
        return arena

    async def _expect(self, requests: Any, field: str, what: str, lease: bool = False) -> Any:
        """The next request, which must be the `field` kind, within the shared
        lease: the one the client's extent is held for (`lease`), or, for a
        call's first message, so that a silent client does not keep a call."""
        step = anext(requests, None)
        lease_s = self._store.config.shared_lease_s
        try:
            async with asyncio.timeout(lease_s):
                request = await step
        except TimeoutError:
            held = "held its extent longer than" if lease else "sent nothing within"
            raise errors.DeadlineExceeded(
                f"{what}: the client {held} the {lease_s:g} s lease") from None
        if request is None or not request.HasField(field):
            raise errors.InvalidArgument(f"{what}: expected a {field} message")
        return getattr(request, field)

    def _extent(self, arena: Arena, buffer: Buffer) -> cache_pb2.Extent:
        offset, length = self._store.extent_of(buffer)
        return cache_pb2.Extent(arena_id=arena.arena_id, offset=offset, length=length)

    @rpc_errors.maps_errors
    async def DeleteSnapshot(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._store.delete(request.snapshot_id)
        return cache_pb2.DeleteSnapshotResponse()

    @rpc_errors.maps_errors
    async def StatSnapshot(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return info_to_proto(self._store.stat(request.snapshot_id))

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
    await store.start()
    transfers = TransferMetrics()
    servicer = CacheServicer(store, ByteLimiter(config.max_inflight_bytes),
                             BandwidthLimiter(config.bandwidth_limit_bytes_per_s), transfers)
    server, port, _health = await rpc_server.create_server(
        address,
        [lambda s: add_servicer(servicer, s)],
        [SERVICE_NAME],
        options=SERVER_OPTIONS, maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        security=security, connections=connections,
    )
    metrics = None
    if config.metrics_port:
        metrics = serve_metrics(store, transfers, config.metrics_port, config.metrics_host)
    sweeper = asyncio.ensure_future(store.run_sweeper())
    return server, port, CacheServer(server, port, store, metrics, sweeper)
