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
through it (cache.proto PutShared/GetShared; kvstash.cache_sdk.shared_arena), and
`put_shared`/`get_shared` let a caller fill or read the extent itself (the
worker gathers KV blocks straight into it). Otherwise, and for snapshots
only on disk, they stream over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
from grpc._cython.cygrpc import ExecuteBatchError

from kvstash import errors
from kvstash.cache_sdk.chunk_codec import (
    ADMITTED_KEY,
    DEFAULT_CHUNK_BYTES,
    RawChunk,
    check_chunk_bytes,
    checksum,
    decode_get_response,
    encode_chunk,
    encode_message,
)
from kvstash.cache_sdk.shared_arena import (
    SharedArena,
    chunk_checksums,
    copy_hashed,
    copy_verified,
    verify_chunks,
)
from kvstash.common import rpc_connections, rpc_errors
from kvstash.common.layout import Layout
from kvstash.common.security import PLAINTEXT, Security
from kvstash.common.wire import layout_to_proto
from kvstash.v1 import cache_pb2, cache_pb2_grpc, common_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")
_PUT_METHOD = "/kvstash.v1.KVCache/PutSnapshot"
_GET_METHOD = "/kvstash.v1.KVCache/GetSnapshot"
# For calls whose caller names no deadline (e.g. a scheduler's stats polls
# and deletes): a stuck cache fails them instead of hanging them.
DEFAULT_TIMEOUT_S = 60.0


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
        self._arena: SharedArena | None = None
        self._arena_known = False  # asked GetArena since the arena last changed
        self._arena_lock = asyncio.Lock()
        self._channel = rpc_connections.channel(address, security)
        self._stub = cache_pb2_grpc.KVCacheStub(self._channel)
        # Puts and gets move chunks in kvstash.cache_sdk.chunk_codec's raw wire format.
        self._put_snapshot = self._channel.stream_unary(
            _PUT_METHOD, request_serializer=encode_message,
            response_deserializer=cache_pb2.PutSnapshotResponse.FromString,
        )
        self._get_snapshot = self._channel.unary_stream(
            _GET_METHOD, request_serializer=encode_message,
            response_deserializer=decode_get_response,
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    # -- the co-located path ----------------------------------------------------

    async def arena(self, timeout_s: float | None = None) -> SharedArena | None:
        """The cache's arena mapped here, or None where it has none or this
        process cannot map it (then `put`/`get_into` stream). Asked once, and
        again after a shared call found the arena changed."""
        if not self.use_arena:
            return None
        async with self._arena_lock:  # one GetArena for many concurrent first calls
            if not self._arena_known:
                await self._ask_arena(timeout_s)
        return self._arena

    async def _ask_arena(self, timeout_s: float | None) -> None:
        try:
            info = await self._stub.GetArena(cache_pb2.GetArenaRequest(),
                                             timeout=self._timeout(timeout_s))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise rpc_errors.error_from_rpc(exc, "cache") from None
            info = cache_pb2.ArenaInfo()  # a cache that predates the arena
        if self._arena is not None and self._arena.arena_id != info.arena_id:
            self._arena.close()
            self._arena = None
        if info.path and self._arena is None:
            try:
                self._arena = await asyncio.to_thread(SharedArena, info)
            except (OSError, ValueError) as exc:
                log.info("cache %s: its arena %s cannot be mapped here (%s); streaming over "
                         "gRPC", self.address, info.path, exc)
        self._arena_known = True

    async def put_shared(
        self, snapshot_id: str, layout: Layout, num_blocks: int, num_tokens: int,
        total_bytes: int, write: Callable[[memoryview], Awaitable[list[int] | None]],
        pinned: bool = True, ttl_s: int = 0, timeout_s: float | None = None,
    ) -> int | None:
        """Puts through the arena: `write(extent)` must fill all total_bytes
        of it, and may return the checksums of its chunks of `chunk_bytes`
        (else they are computed here); then the put is committed. Returns the
        bytes stored, or None where there is no arena to use (call `put`).
        The extent is leased to the call, so the call outlives `write`, even
        when cancelled (see `_to_the_end`)."""
        arena = await self.arena(timeout_s)
        if arena is None:
            return None
        header = self._header(snapshot_id, layout, num_blocks, num_tokens, total_bytes, pinned,
                              ttl_s)
        call = self._stub.PutShared(timeout=self._timeout(timeout_s))
        try:
            await call.write(cache_pb2.PutSharedRequest(header=header))
            try:
                reply = await self._next(call, snapshot_id)
            except errors.FailedPrecondition:  # the cache has no arena now: stream
                self._arena_known = False
                call.cancel()
                return None
            extent = arena.view(reply.extent)
            sums = await _to_the_end(write(extent))
            if sums is None:
                sums = await _to_the_end(
                    asyncio.to_thread(chunk_checksums, extent, self.chunk_bytes))
            del extent
            commit = cache_pb2.SharedPutCommit(checksums=sums)
            await call.write(cache_pb2.PutSharedRequest(commit=commit))
            response = await self._next(call, snapshot_id)
            await _half_close(call)
            await self._finish(call)
        except errors.Unavailable:
            self._arena_known = False  # it may have changed: ask again next time
            call.cancel()
            raise
        except BaseException:
            call.cancel()
            raise
        return int(response.info.header.total_bytes)

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
        call = self._stub.GetShared(timeout=self._timeout(timeout_s))
        try:
            request = cache_pb2.GetSnapshotRequest(snapshot_id=snapshot_id, consume=consume)
            await call.write(cache_pb2.GetSharedRequest(open=request))
            try:
                response = await self._next(call, snapshot_id)
            except errors.FailedPrecondition:  # on disk, or the cache has no arena now
                self._arena_known = False
                return None
            extent = arena.view(response.extent)
            checksums = list(response.checksums)
            if not verified_by_read:
                await _to_the_end(asyncio.to_thread(
                    verify_chunks, extent, response.header.chunk_bytes, checksums,
                    f"snapshot {snapshot_id}"))
            await _to_the_end(read(response.header, extent, checksums))
            del extent
            await call.write(cache_pb2.GetSharedRequest(done=cache_pb2.SharedGetDone()))
            await _half_close(call)
            await self._finish(call)
        except errors.Unavailable:
            self._arena_known = False
            raise
        finally:
            call.cancel()  # no-op once finished
        return response.header

    @staticmethod
    async def _next(call: Any, snapshot_id: str) -> Any:
        """The next response of a shared call; its error status, raised."""
        try:
            response = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise rpc_errors.error_from_rpc(exc, "cache") from None
        if response is grpc.aio.EOF:
            raise errors.Unavailable(f"cache ended the call on {snapshot_id} early")
        return response

    @staticmethod
    async def _finish(call: Any) -> None:
        """Waits for a shared call's status; raises it unless OK."""
        try:
            extra = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise rpc_errors.error_from_rpc(exc, "cache") from None
        if extra is not grpc.aio.EOF:
            raise errors.DataLoss(f"cache sent an unexpected message: {type(extra).__name__}")

    def _header(
        self, snapshot_id: str, layout: Layout, num_blocks: int, num_tokens: int,
        total_bytes: int, pinned: bool, ttl_s: int,
    ) -> cache_pb2.SnapshotHeader:
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

        async def fill(extent: memoryview) -> list[int]:
            return await asyncio.to_thread(copy_hashed, extent, view, self.chunk_bytes)

        stored = await self.put_shared(snapshot_id, layout, num_blocks, num_tokens, view.nbytes,
                                       fill, pinned, ttl_s, timeout_s)
        if stored is not None:
            return stored
        header = self._header(snapshot_id, layout, num_blocks, num_tokens, view.nbytes, pinned,
                              ttl_s)
        call = self._put_snapshot(timeout=self._timeout(timeout_s))
        try:
            await call.write(cache_pb2.PutSnapshotRequest(header=header))
            # The server answers with initial metadata once it has reserved
            # room (or ends the call refusing). Sending payload only after that
            # keeps puts that wait for room from filling the server's buffers.
            metadata = await call.initial_metadata()
            if metadata is None or metadata.get(ADMITTED_KEY) is None:
                await _half_close(call)
                response = await call  # raises the refusal
            else:
                for index, start in enumerate(range(0, view.nbytes, self.chunk_bytes)):
                    piece = view[start : start + self.chunk_bytes]
                    # One copy, into the message; write() waits for HTTP/2
                    # flow control.
                    await call.write(encode_chunk(index, piece, checksum(piece)))
                await _half_close(call)
                response = await call
        except asyncio.InvalidStateError:  # the server ended the call mid-stream
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                raise rpc_errors.error_from_rpc(exc, "cache") from None
            raise errors.Unavailable(f"cache ended put {snapshot_id} early") from None
        except grpc.aio.AioRpcError as exc:
            raise rpc_errors.error_from_rpc(exc, "cache") from None
        except BaseException:
            call.cancel()
            raise
        return int(response.info.header.total_bytes)

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
        return await self._read(snapshot_id, start_chunk, consume, timeout_s, check_size)

    async def get(
        self, snapshot_id: str, consume: bool = False, timeout_s: float | None = None
    ) -> tuple[cache_pb2.SnapshotHeader, bytes]:
        """The whole snapshot in a new buffer; `consume` as for `get_into`."""
        buffers: list[bytearray] = []

        def allocate(header: cache_pb2.SnapshotHeader) -> memoryview:
            buffers.append(bytearray(header.total_bytes))
            return memoryview(buffers[0])

        header = await self._read(snapshot_id, 0, consume, timeout_s, allocate)
        return header, bytes(buffers[0])

    async def delete(self, snapshot_id: str, timeout_s: float | None = None) -> None:
        request = cache_pb2.DeleteSnapshotRequest(snapshot_id=snapshot_id)
        timeout = self._timeout(timeout_s)
        await self._call(lambda: self._stub.DeleteSnapshot(request, timeout=timeout))

    async def stat(
        self, snapshot_id: str, timeout_s: float | None = None
    ) -> cache_pb2.SnapshotInfo:
        request = cache_pb2.StatSnapshotRequest(snapshot_id=snapshot_id)
        timeout = self._timeout(timeout_s)
        return await self._call(lambda: self._stub.StatSnapshot(request, timeout=timeout))

    async def stats(self, timeout_s: float | None = None) -> cache_pb2.CacheStats:
        request = common_pb2.GetStatsRequest()
        timeout = self._timeout(timeout_s)
        return await self._call(lambda: self._stub.GetStats(request, timeout=timeout))

    def _timeout(self, timeout_s: float | None) -> float | None:
        """The deadline of one call: the caller's, else the client's."""
        return self.timeout_s if timeout_s is None else timeout_s

    async def _read(
        self, snapshot_id: str, start_chunk: int, consume: bool, timeout_s: float | None,
        target_for: Callable[[cache_pb2.SnapshotHeader], memoryview],
    ) -> cache_pb2.SnapshotHeader:
        request = cache_pb2.GetSnapshotRequest(
            snapshot_id=snapshot_id, start_chunk=start_chunk, consume=consume)
        call = self._get_snapshot(request, timeout=self._timeout(timeout_s))
        header: cache_pb2.SnapshotHeader | None = None
        target = memoryview(b"")
        expected = start_chunk
        try:
            async for response in call:
                if not isinstance(response, RawChunk):
                    header = response
                    target = target_for(header)
                    continue
                if header is None:
                    raise errors.DataLoss(f"snapshot {snapshot_id}: chunk before the header")
                expected = _place_chunk(header, response, expected, target)
        except grpc.aio.AioRpcError as exc:
            raise rpc_errors.error_from_rpc(exc, "cache") from None
        finally:
            call.cancel()  # no-op when finished; stops the server when we raise
        if header is None:
            raise errors.DataLoss(f"snapshot {snapshot_id}: stream ended without a header")
        num_chunks = -(-header.total_bytes // header.chunk_bytes)
        if expected != num_chunks:
            raise errors.DataLoss(
                f"snapshot {snapshot_id}: stream ended after chunk {expected - 1} "
                f"of {num_chunks}"
            )
        return header

    async def _call(self, make_call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await make_call()
        except grpc.aio.AioRpcError as exc:
            raise rpc_errors.error_from_rpc(exc, "cache") from None


async def _to_the_end(step: Awaitable[T]) -> T:
    """Awaits `step`; if the caller is cancelled meanwhile, still lets it
    finish (a copy on a thread cannot be stopped) before the cancellation goes
    on. So a shared call never ends, giving its extent back to the cache, while
    this process still touches the extent."""
    task = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait((task,))
        raise


def _place_chunk(
    header: cache_pb2.SnapshotHeader, chunk: RawChunk, expected: int, target: memoryview
) -> int:
    """Checks one received chunk and copies it into place; returns the next index."""
    sid = header.snapshot_id
    if chunk.index != expected:
        raise errors.DataLoss(f"snapshot {sid}: got chunk {chunk.index}, expected {expected}")
    data = chunk.data
    start = chunk.index * header.chunk_bytes
    end = min(start + header.chunk_bytes, header.total_bytes)
    if len(data) != end - start:
        raise errors.DataLoss(
            f"snapshot {sid}: chunk {chunk.index} has {len(data)} bytes, "
            f"expected {end - start}"
        )
    actual = checksum(data)
    if actual != chunk.checksum:
        raise errors.DataLoss(
            f"snapshot {sid}: chunk {chunk.index} checksum {actual:#018x}, "
            f"server sent {chunk.checksum:#018x}"
        )
    target[start:end] = data
    return expected + 1


async def _half_close(call: Any) -> None:
    """Tells the server no more requests come. A call that has already ended
    (its deadline passed, or the server answered) cannot take that; grpc
    then raises InvalidStateError or its internal ExecuteBatchError, and
    awaiting the call, next, says how it ended."""
    with contextlib.suppress(asyncio.InvalidStateError, ExecuteBatchError):
        await call.done_writing()
