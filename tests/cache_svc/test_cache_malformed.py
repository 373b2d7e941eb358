"""Every malformed put is refused with its status code and leaves nothing
behind: no snapshot, no reservation, no file."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from cache_helpers import (
    MIB,
    bytes_per_block,
    chunk_msg,
    make_header,
    make_layout,
    make_payload,
    send,
    split,
    wait_until,
)

from cache_svc.put_stream import PutStream
from kvstash.v1 import cache_pb2

LAYOUT = make_layout()  # 32 KiB blocks
BLOCK = bytes_per_block(LAYOUT)
NUM_BLOCKS = 100  # 3.125 MiB: chunks of 1, 1, 1 and 0.125 MiB
DATA = make_payload(LAYOUT, NUM_BLOCKS).tobytes()
PIECES = split(DATA, MIB)
HEADER = cache_pb2.PutSnapshotRequest(header=make_header("snap", LAYOUT, NUM_BLOCKS))


def good(indices: list[int]) -> list[cache_pb2.PutSnapshotRequest]:
    return [chunk_msg(i, PIECES[i]) for i in indices]


def with_header(**fields) -> list[cache_pb2.PutSnapshotRequest]:
    header = make_header(fields.pop("snapshot_id", "snap"), LAYOUT, NUM_BLOCKS, **fields)
    return [cache_pb2.PutSnapshotRequest(header=header), *good([0, 1, 2, 3])]


OK = grpc.StatusCode.OK
BAD = grpc.StatusCode.INVALID_ARGUMENT
CASES = {
    # name: (messages sent, expected status, words the message must contain)
    "missing_middle_chunk": ([HEADER, *good([0, 1, 3])], BAD, "chunk 3 is out of order"),
    "missing_last_chunk": ([HEADER, *good([0, 1, 2])], BAD, "chunk 3 is missing"),
    "no_chunks": ([HEADER], BAD, "after 0 of 4 chunks"),
    "extra_chunk": ([HEADER, *good([0, 1, 2, 3]), chunk_msg(4, b"x" * 10)], BAD,
                    "chunk 4 is extra"),
    "duplicated_chunk": ([HEADER, *good([0, 1, 1, 2, 3])], BAD, "chunk 1 is a duplicate"),
    "out_of_order": ([HEADER, *good([0, 2, 1, 3])], BAD, "chunk 2 is out of order"),
    "short_chunk": ([HEADER, *good([0]), chunk_msg(1, PIECES[1][:-1]), *good([2, 3])], BAD,
                    "chunk 1 has 1048575 bytes, expected 1048576"),
    "long_last_chunk": ([HEADER, *good([0, 1, 2]), chunk_msg(3, PIECES[3] + b"\0")], BAD,
                        "chunk 3 has 131073 bytes, expected 131072"),
    "oversize_chunk": ([HEADER, chunk_msg(0, PIECES[0] + b"\0"), *good([1, 2, 3])], BAD,
                       "chunk 0 has 1048577 bytes, expected 1048576"),
    "checksum_mismatch": ([HEADER, *good([0, 1]), chunk_msg(2, PIECES[2], checksum=12345),
                           *good([3])], grpc.StatusCode.DATA_LOSS, "chunk 2 checksum mismatch"),
    "payload_before_header": ([*good([0]), HEADER, *good([1, 2, 3])], BAD,
                              "first message is chunk 0"),
    "second_header": ([HEADER, *good([0, 1]), HEADER, *good([2, 3])], BAD,
                      "second header after 2 chunks"),
    "empty_stream": ([], BAD, "stream is empty"),
    "id_path_traversal": (with_header(snapshot_id="../x"), BAD, "outside [A-Za-z0-9._-]"),
    "id_slash": (with_header(snapshot_id="a/b"), BAD, "outside [A-Za-z0-9._-]"),
    "id_empty": (with_header(snapshot_id=""), BAD, "snapshot id is empty"),
    "id_200_chars": (with_header(snapshot_id="a" * 200), BAD, "has 200 chars, at most 128"),
    "id_leading_dot": (with_header(snapshot_id=".hidden"), BAD, "must not start with '.'"),
    "total_bytes_inconsistent": (with_header(total_bytes=len(DATA) + 1), BAD,
                                 "100 blocks of 32768 bytes make 3276800"),
    "chunk_bytes_too_small": (with_header(chunk_bytes=MIB - 1), BAD, "chunk_bytes is 1048575"),
    "chunk_bytes_too_large": (with_header(chunk_bytes=4 * MIB + 1), BAD,
                              "chunk_bytes is 4194305"),
}


def unknown_checksum() -> list[cache_pb2.PutSnapshotRequest]:
    messages = with_header()
    messages[0].header.checksum_algorithm = cache_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED
    return messages


def unknown_dtype() -> list[cache_pb2.PutSnapshotRequest]:
    messages = with_header()
    messages[0].header.layout.dtype = "int8"
    return messages


CASES["unknown_checksum_algorithm"] = (unknown_checksum(), BAD, "checksum algorithm 0")
CASES["unknown_dtype"] = (unknown_dtype(), BAD, "dtype 'int8' unknown")


@pytest.mark.parametrize("case", list(CASES))
async def test_malformed_put_is_rejected_and_leaves_nothing(start_cache, case) -> None:
    messages, code, words = CASES[case]
    running = await start_cache()
    error = await send(running.stub, messages)
    assert error is not None, "the put was accepted"
    assert error.code() == code, error.details()
    assert words in error.details()
    await running.assert_nothing_left()
    # The same id still works afterwards: nothing half-made blocks it.
    assert await send(running.stub, [HEADER, *good([0, 1, 2, 3])]) is None


async def test_a_chunk_larger_than_declared_is_refused_before_the_next_is_read(
        start_cache, monkeypatch) -> None:
    """The put's share of the in-flight budget covers chunks of the sizes its
    header declared (here 64 KiB in all): a client sending 4 MiB chunks
    regardless gets no second chunk read into the server."""
    asked: list[int] = []
    read_ahead = PutStream.read_ahead

    async def counted(self, num_bytes: int) -> None:
        asked.append(num_bytes)
        await read_ahead(self, num_bytes)

    monkeypatch.setattr(PutStream, "read_ahead", counted)
    running = await start_cache()
    header = make_header("snap", LAYOUT, 2, chunk_bytes=4 * MIB)  # 64 KiB, one chunk
    big = bytes(4 * MIB)
    error = await send(running.stub, [cache_pb2.PutSnapshotRequest(header=header),
                                      *(chunk_msg(i, big) for i in range(3))])
    assert error is not None and error.code() == BAD
    assert "chunk 0 has 4194304 bytes, expected 65536" in (error.details() or "")
    # The put asked for its one chunk, at its declared size; what follows is
    # the refused put's drain (reading out and dropping, in its own share,
    # paced by what arrives rather than booked ahead).
    assert asked[0] == 2 * BLOCK and set(asked[1:]) <= {0}
    await running.assert_nothing_left()


async def test_well_formed_control_case_is_accepted(start_cache) -> None:
    running = await start_cache()
    assert await send(running.stub, [HEADER, *good([0, 1, 2, 3])]) is None
    _, data = await running.client.get("snap")
    assert data == DATA


async def test_duplicate_id_is_already_exists(start_cache) -> None:
    running = await start_cache()
    assert await send(running.stub, [HEADER, *good([0, 1, 2, 3])]) is None
    error = await send(running.stub, [HEADER, *good([0, 1, 2, 3])])
    assert error is not None and error.code() == grpc.StatusCode.ALREADY_EXISTS


async def stalled_put(running):
    """Starts a put that sends the header and one chunk, then stalls; returns
    the call once the server has reserved room for it."""
    stall = asyncio.Event()

    async def requests():
        yield HEADER
        yield chunk_msg(0, PIECES[0])
        await stall.wait()

    call = running.stub.PutSnapshot(requests(), timeout=60)

    async def going() -> bool:
        stats = await running.client.stats()
        return bool(stats.reserved_bytes and stats.bytes_in)

    await wait_until(going, "the put got going")
    return call


async def test_client_cancellation_mid_stream_leaves_nothing(start_cache) -> None:
    running = await start_cache()
    call = await stalled_put(running)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call

    async def failed() -> bool:
        # The reservation goes back once the populating thread has let go of
        # the buffer, a moment after the failure is counted.
        stats = await running.client.stats()
        return stats.num_failed_puts == 1 and stats.reserved_bytes == 0

    await wait_until(failed, "the cancelled put is counted and released")
    await running.assert_nothing_left()


async def test_server_shutdown_mid_stream_aborts_put(start_cache) -> None:
    running = await start_cache()
    call = await stalled_put(running)
    await running.cache.stop(grace_s=0.2)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    stats = running.cache.store.stats()
    assert stats.reserved_bytes == 0 and stats.num_failed_puts == 1
    assert stats.memory_snapshots == 0 and running.disk_files() == []
