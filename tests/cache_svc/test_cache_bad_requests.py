"""Requests no protobuf reader accepts, and ids far too long, over a real
channel: INVALID_ARGUMENT with a short, plain message on every call, and
nothing left reserved."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from cache_helpers import chunk_msg, make_header, make_layout, make_payload, wait_until

from kvstash.v1 import cache_pb2

LAYOUT = make_layout()  # 32 KiB blocks
NUM_BLOCKS = 64  # 2 MiB: two chunks of 1 MiB
PIECES = [bytes(p) for p in make_payload(LAYOUT, NUM_BLOCKS).reshape(2, -1)]
HEADER = cache_pb2.PutSnapshotRequest(header=make_header("snap", LAYOUT, NUM_BLOCKS))
METHOD = "/kvstash.v1.KVCache/"
# A string field (snapshot_id = 1, in the header = 1 for a put) holding
# invalid UTF-8, and bytes that are no protobuf message at all.
BAD_UTF8_ID = b"\x0a\x02\xc3\x28"
BAD_UTF8_HEADER = b"\x0a\x04" + BAD_UTF8_ID
GARBAGE = b"\xff\xff\xff\xff\x0f"
TRUNCATED_CHUNK = b"\x12\x7f\x08\x01"  # a chunk field claiming 127 bytes, holding 2


def assert_plain_invalid_argument(code: grpc.StatusCode, details: str) -> None:
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "<class" not in details and "DecodeError" not in details, details
    assert len(details) < 300, details


async def call_raw(channel: grpc.aio.Channel, method: str, *messages: bytes
                   ) -> tuple[grpc.StatusCode, str]:
    """Sends these exact bytes to `method`; the status code and details."""
    identity = bytes
    try:
        if method == "PutSnapshot":
            async def requests() -> AsyncIterator[bytes]:
                for message in messages:
                    yield message

            call = channel.stream_unary(METHOD + method, request_serializer=identity)
            await call(requests(), timeout=30)
        elif method == "GetSnapshot":
            stream = channel.unary_stream(METHOD + method, request_serializer=identity)
            async for _ in stream(messages[0], timeout=30):
                pass
        else:
            unary = channel.unary_unary(METHOD + method, request_serializer=identity)
            await unary(messages[0], timeout=30)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("method", ["GetSnapshot", "StatSnapshot", "DeleteSnapshot"])
@pytest.mark.parametrize("request_bytes", [BAD_UTF8_ID, GARBAGE], ids=["bad_utf8", "garbage"])
async def test_undecodable_request_is_invalid_argument(start_cache, method: str,
                                                       request_bytes: bytes) -> None:
    running = await start_cache()
    code, details = await call_raw(running.channel, method, request_bytes)
    assert_plain_invalid_argument(code, details)


@pytest.mark.parametrize(
    "messages",
    [
        [GARBAGE],
        [BAD_UTF8_HEADER, chunk_msg(0, PIECES[0]).SerializeToString()],
        [HEADER.SerializeToString(), GARBAGE, chunk_msg(1, PIECES[1]).SerializeToString()],
        [HEADER.SerializeToString(), chunk_msg(0, PIECES[0]).SerializeToString(),
         TRUNCATED_CHUNK],
    ],
    ids=["garbage_first", "bad_utf8_header", "garbage_second", "truncated_chunk_third"],
)
async def test_undecodable_put_message_is_invalid_argument_and_leaves_nothing(
    start_cache, messages: list[bytes]
) -> None:
    running = await start_cache()
    channel = running.channel
    code, details = await call_raw(channel, "PutSnapshot", *messages)
    assert_plain_invalid_argument(code, details)

    async def released() -> bool:
        # A put refused after admission gives its room back once the thread
        # faulting its buffer in lets go, a moment after the status is sent.
        return (await running.client.stats()).reserved_bytes == 0

    await wait_until(released, "the refused put's reservation is released")
    await running.assert_nothing_left()
    # The server is fine afterwards: the same id can be put.
    good = [HEADER, chunk_msg(0, PIECES[0]), chunk_msg(1, PIECES[1])]
    code, details = await call_raw(channel, "PutSnapshot", *(m.SerializeToString() for m in good))
    assert code == grpc.StatusCode.OK, details


LONG_ID = "a" * 10_000


@pytest.mark.parametrize("method", ["PutSnapshot", "GetSnapshot", "StatSnapshot",
                                    "DeleteSnapshot"])
async def test_huge_snapshot_id_is_a_short_invalid_argument(start_cache, method: str) -> None:
    # Echoed whole, the id would overflow gRPC's metadata limit and come back
    # as RESOURCE_EXHAUSTED "metadata size exceeds soft limit".
    running = await start_cache()
    if method == "PutSnapshot":
        header = make_header(LONG_ID, LAYOUT, NUM_BLOCKS)
        messages = [cache_pb2.PutSnapshotRequest(header=header).SerializeToString(),
                    chunk_msg(0, PIECES[0]).SerializeToString()]
    elif method == "GetSnapshot":
        messages = [cache_pb2.GetSnapshotRequest(snapshot_id=LONG_ID).SerializeToString()]
    elif method == "StatSnapshot":
        messages = [cache_pb2.StatSnapshotRequest(snapshot_id=LONG_ID).SerializeToString()]
    else:
        messages = [cache_pb2.DeleteSnapshotRequest(snapshot_id=LONG_ID).SerializeToString()]
    code, details = await call_raw(running.channel, method, *messages)
    assert_plain_invalid_argument(code, details)
    assert "10000 chars, at most 128" in details
    assert LONG_ID[:50] not in details


async def test_unknown_long_valid_id_is_echoed_as_a_prefix(start_cache) -> None:
    running = await start_cache()
    name = "x" * 128  # valid, but not there
    code, details = await call_raw(
        running.channel, "StatSnapshot",
        cache_pb2.StatSnapshotRequest(snapshot_id=name).SerializeToString())
    assert code == grpc.StatusCode.NOT_FOUND
    assert "x" * 40 in details and "x" * 41 not in details and "(128 chars)" in details


async def test_a_stalled_put_is_abandoned_and_its_room_returned(start_cache) -> None:
    """A slow-loris client: the header reserves room, then nothing comes."""
    running = await start_cache(put_idle_s=0.5)
    stalled = asyncio.Event()

    async def header_then_silence() -> AsyncIterator[cache_pb2.PutSnapshotRequest]:
        yield cache_pb2.PutSnapshotRequest(header=make_header("s", make_layout(), 64))
        stalled.set()
        await asyncio.sleep(3600)

    call = running.stub.PutSnapshot(header_then_silence(), timeout=60)
    await stalled.wait()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "sent nothing for 0.5 s" in (info.value.details() or "")
    await running.assert_nothing_left()
