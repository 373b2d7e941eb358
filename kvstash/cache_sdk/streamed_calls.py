"""The cache client's streamed path: a snapshot's bytes as chunks over gRPC.

    put:  header --> (wait for the cache's ADMITTED metadata) --> chunk 0..n-1 --> half-close
    get:  request --> header, chunk start..n-1 (each checked, then copied into place)

Chunks travel in kvstash.cache_sdk.chunk_codec's raw wire format (one copy,
into or out of the message), each with its xxh3 checksum; a chunk out of
order, of the wrong size or failing its checksum is `DataLoss`, a failed call
the kvstash.errors class of its status. CacheClient takes this path where the
cache's arena cannot be mapped (kvstash.cache_sdk.arena_calls), and for
snapshots only on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc
from grpc._cython.cygrpc import ExecuteBatchError

from kvstash import errors
from kvstash.cache_sdk import refusals
from kvstash.cache_sdk.chunk_codec import (
    ADMITTED_KEY,
    RawChunk,
    check_received_header,
    checksum,
    decode_get_response,
    encode_chunk,
    encode_message,
)
from kvstash.common import rpc_errors
from kvstash.v1 import cache_pb2

_PUT_METHOD = "/kvstash.v1.KVCache/PutSnapshot"
_GET_METHOD = "/kvstash.v1.KVCache/GetSnapshot"


class StreamedCalls:
    """PutSnapshot and GetSnapshot on one channel, in the raw chunk codec. Each
    `timeout_s` is the call's deadline as CacheClient resolved it (None = none)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._put_snapshot = channel.stream_unary(
            _PUT_METHOD, request_serializer=encode_message,
            response_deserializer=cache_pb2.PutSnapshotResponse.FromString,
        )
        self._get_snapshot = channel.unary_stream(
            _GET_METHOD, request_serializer=encode_message,
            response_deserializer=decode_get_response,
        )

    async def put(self, header: cache_pb2.SnapshotHeader, view: memoryview,
                  timeout_s: float | None) -> int:
        """Streams `view` (header.total_bytes long) in chunks of
        header.chunk_bytes; returns the bytes stored."""
        call = self._put_snapshot(timeout=timeout_s)
        try:
            try:
                await call.write(cache_pb2.PutSnapshotRequest(header=header))
            except grpc.aio.AioRpcError as exc:  # the cache has none of the put
                raise refusals.error_from_rpc(await _status(call, exc), unsent=True) from None
            # The server answers with initial metadata once it has reserved
            # room (or ends the call refusing). Sending payload only after that
            # keeps puts that wait for room from filling the server's buffers.
            metadata = await call.initial_metadata()
            if metadata is None or metadata.get(ADMITTED_KEY) is None:
                await half_close(call)
                response = await call  # raises the refusal
            else:
                for index, start in enumerate(range(0, view.nbytes, header.chunk_bytes)):
                    piece = view[start : start + header.chunk_bytes]
                    # One copy, into the message; write() waits for HTTP/2
                    # flow control.
                    await call.write(encode_chunk(index, piece, checksum(piece)))
                await half_close(call)
                response = await call
            response = rpc_errors.decoded(response, f"cache: put of {header.snapshot_id}")
        except asyncio.InvalidStateError:  # the server ended the call mid-stream
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                raise refusals.error_from_rpc(exc) from None
            raise errors.Unavailable(f"cache ended put {header.snapshot_id} early") from None
        except grpc.aio.AioRpcError as exc:
            raise refusals.error_from_rpc(await _status(call, exc)) from None
        except BaseException:
            call.cancel()
            raise
        return int(response.info.header.total_bytes)

    async def read(
        self, snapshot_id: str, start_chunk: int, consume: bool, timeout_s: float | None,
        target_for: Callable[[cache_pb2.SnapshotHeader], memoryview],
    ) -> cache_pb2.SnapshotHeader:
        """Reads the snapshot from `start_chunk` on into the buffer that
        `target_for(header)` gives once the header came; returns the header.
        Raises DataLoss unless every chunk from the start one came, checked."""
        request = cache_pb2.GetSnapshotRequest(
            snapshot_id=snapshot_id, start_chunk=start_chunk, consume=consume)
        call = self._get_snapshot(request, timeout=timeout_s)
        header: cache_pb2.SnapshotHeader | None = None
        target = memoryview(b"")
        expected = start_chunk
        try:
            async for message in call:
                response = rpc_errors.decoded(message, f"cache: snapshot {snapshot_id}")
                if not isinstance(response, RawChunk):
                    if header is not None:
                        raise errors.DataLoss(f"snapshot {snapshot_id}: a second header")
                    check_received_header(response, f"snapshot {snapshot_id}")
                    header = response
                    target = target_for(header)
                    continue
                if header is None:
                    raise errors.DataLoss(f"snapshot {snapshot_id}: chunk before the header")
                expected = _place_chunk(header, response, expected, target)
        except grpc.aio.AioRpcError as exc:
            raise refusals.error_from_rpc(exc) from None
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


async def _status(call: Any, exc: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """`exc`, or where grpc-python made it up for a failed write, the status
    the call ended with, which says why. (grpc may have overwritten that
    with its own, too: then `exc`.)"""
    if refusals.is_local_failure(exc):
        try:
            await call
        except grpc.aio.AioRpcError as ended:
            return ended
    return exc


async def half_close(call: Any) -> None:
    """Tells the server no more requests come. A call that has already ended
    (its deadline passed, or the server answered) cannot take that; grpc
    then raises InvalidStateError or its internal ExecuteBatchError, and
    awaiting the call, next, says how it ended."""
    with contextlib.suppress(asyncio.InvalidStateError, ExecuteBatchError):
        await call.done_writing()
