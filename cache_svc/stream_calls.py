"""PutSnapshot and GetSnapshot: a snapshot's chunks streamed over gRPC.

Each call is paced by the server-wide limits: the in-flight budget
(`ByteLimiter`, what gRPC may hold for a call) and the bandwidth limit. A put
is admitted only once the store reserved its room, and its payload is asked
for one chunk ahead (`PutStream`); a refused or failed put reads out what its
client still sends, briefly, so the client learns why. A get sends one chunk
at a time, each within get_idle_s or the call ends. Mixed into
`cache_svc.server.CacheServicer`, which sets the fields declared below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from collections.abc import Iterator
from typing import Any

import grpc

from cache_svc.convert import info_to_proto, meta_from_proto, meta_to_proto
from cache_svc.limiter import BandwidthLimiter, ByteLimiter
from cache_svc.metrics import TransferMetrics
from cache_svc.model import SnapshotInfo
from cache_svc.put_stream import DRAIN_SHARE_BYTES, PutStream, put_share_bytes
from cache_svc.store import SnapshotStore
from kvstash import errors
from kvstash.cache_sdk.chunk_codec import RawChunk, encode_chunk
from kvstash.common import rpc_errors
from kvstash.v1 import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)

DRAIN_LIMIT_S = 5.0  # how long a failed put reads out a client still sending


async def _end_call(context: grpc.aio.ServicerContext, exc: errors.KvstashError) -> None:
    """Sends `exc`'s status from outside the call's handler, unless the call
    has ended meanwhile (then it keeps the status it has: one per call)."""
    # AbortError: sent. CancelledError: the call had ended (rpc_errors.end_call).
    with contextlib.suppress(grpc.aio.AbortError, asyncio.CancelledError):
        await rpc_errors.abort_with(context, exc)


class StreamedCalls(cache_pb2_grpc.KVCacheServicer):
    """The streamed RPCs of `CacheServicer`; its __init__ sets these fields."""

    _store: SnapshotStore
    _limiter: ByteLimiter  # bounds bytes in flight
    _bandwidth: BandwidthLimiter  # bounds bytes per second
    _metrics: TransferMetrics
    _endings: set[asyncio.Future[None]]  # see _taken_within

    @rpc_errors.maps_errors
    async def PutSnapshot(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> Any:
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
                        # Paced below by what arrives: booking the largest
                        # message up front cost every refusal (the client
                        # then sends nothing) MAX_CHUNK_BYTES of link time.
                        await stream.read_ahead(0)
                    request = await stream.take()
                    num_bytes = request.data.nbytes if isinstance(request, RawChunk) else 0
                    del request  # not kept while the next one is asked for
                    await self._bandwidth.take(num_bytes)

    # An async generator, the handler shape grpc's interceptors (tracing's
    # among them) support. grpc awaits each send before asking for the next
    # message, so a slow reader slows this loop instead of growing a buffer.
    @rpc_errors.maps_errors
    async def GetSnapshot(  # type: ignore[override]
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        started = time.perf_counter()
        reads = self._store.reads
        try:
            reader = await reads.open_reader(request.snapshot_id, request.start_chunk,
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
                        data, digest = await reads.read_chunk(reader, index)
                    except errors.KvstashError as exc:
                        await rpc_errors.abort_with(context, exc)
                    message = encode_chunk(index, data, digest)  # the one copy
                    del data
                    with self._taken_within(context, what):
                        yield message
                    del message
            finished = True
        finally:
            reads.close_reader(reader, finished)
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
