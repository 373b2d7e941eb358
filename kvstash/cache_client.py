"""Async client of the KVCache service, used by the worker and the scheduler.

Callers only ever see kvstash.errors (`DataLoss` for a bad chunk, either
side), never grpc exceptions:

    async with CacheClient("127.0.0.1:50071") as cache:
        await cache.put("req-7", layout, num_blocks=4, num_tokens=60, data=host_buf,
                        timeout_s=remaining)
        header = await cache.get_into("req-7", memoryview(host_buf), consume=True)

Deadlines belong to the caller: every call takes `timeout_s` (seconds for the
whole call, from the header to the last chunk), so a transfer made on behalf
of an RPC is bounded by that RPC's remaining time. A call given none gets the
client's `timeout_s`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Self, TypeVar

import grpc

from kvstash import errors, rpc
from kvstash.chunk_codec import (
    ADMITTED_KEY,
    DEFAULT_CHUNK_BYTES,
    RawChunk,
    check_chunk_bytes,
    checksum,
    decode_get_response,
    encode_chunk,
    encode_message,
)
from kvstash.v1 import cache_pb2, cache_pb2_grpc, common_pb2

T = TypeVar("T")
_PUT_METHOD = "/kvstash.v1.KVCache/PutSnapshot"
_GET_METHOD = "/kvstash.v1.KVCache/GetSnapshot"
# For calls whose caller names no deadline (e.g. a scheduler's stats polls
# and deletes): a stuck cache fails them instead of hanging them.
DEFAULT_TIMEOUT_S = 60.0


class CacheClient:
    def __init__(
        self, address: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        """`timeout_s`: deadline of a call given none (None = no deadline).
        Raises InvalidArgument (a ValueError) for a bad `chunk_bytes`."""
        check_chunk_bytes(chunk_bytes)
        self.address = address
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self._channel = rpc.insecure_channel(address)
        self._stub = cache_pb2_grpc.KVCacheStub(self._channel)
        # Puts and gets move chunks in kvstash.chunk_codec's raw wire format.
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

    async def put(
        self,
        snapshot_id: str,
        layout: common_pb2.KvLayout,
        num_blocks: int,
        num_tokens: int,
        data: object,
        pinned: bool = True,
        ttl_s: int = 0,
        timeout_s: float | None = None,
    ) -> int:
        """Streams the snapshot; returns the bytes stored. `data` is any
        C-contiguous buffer (bytes, bytearray, memoryview, numpy array...).
        `timeout_s` bounds the whole put, waiting for room included."""
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        header = cache_pb2.SnapshotHeader(
            snapshot_id=snapshot_id, layout=layout, num_blocks=num_blocks,
            num_tokens=num_tokens, total_bytes=view.nbytes, chunk_bytes=self.chunk_bytes,
            checksum_algorithm=cache_pb2.CHECKSUM_ALGORITHM_XXH3_64, pinned=pinned, ttl_s=ttl_s,
        )
        call = self._put_snapshot(timeout=self._timeout(timeout_s))
        try:
            await call.write(cache_pb2.PutSnapshotRequest(header=header))
            # The server answers with initial metadata once it has reserved
            # room (or ends the call refusing). Sending payload only after that
            # keeps puts that wait for room from filling the server's buffers.
            metadata = await call.initial_metadata()
            if metadata is None or metadata.get(ADMITTED_KEY) is None:
                await call.done_writing()
                response = await call  # raises the refusal
            else:
                for index, start in enumerate(range(0, view.nbytes, self.chunk_bytes)):
                    piece = view[start : start + self.chunk_bytes]
                    # One copy, into the message; write() waits for HTTP/2
                    # flow control.
                    await call.write(encode_chunk(index, piece, checksum(piece)))
                await call.done_writing()
                response = await call
        except asyncio.InvalidStateError:  # the server ended the call mid-stream
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                raise rpc.error_from_rpc(exc, "cache") from None
            raise errors.Unavailable(f"cache ended put {snapshot_id} early") from None
        except grpc.aio.AioRpcError as exc:
            raise rpc.error_from_rpc(exc, "cache") from None
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
        if this then refuses it); a read that ends before that leaves it."""
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
            raise rpc.error_from_rpc(exc, "cache") from None
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
            raise rpc.error_from_rpc(exc, "cache") from None


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
