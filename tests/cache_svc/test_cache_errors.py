"""What a failed cache call raises: one status <-> error mapping
(kvstash.common.rpc_errors) for the cache server, the cache client and the
worker in between."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from cache_helpers import bytes_per_block, make_header, make_layout

from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.cache_sdk.shared_arena import arena_file_name
from kvstash.common import rpc_errors, rpc_server
from kvstash.common.layout import Layout
from kvstash.v1 import cache_pb2, cache_pb2_grpc


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    ("code", "error", "message"),
    [
        (grpc.StatusCode.NOT_FOUND, errors.NotFound, "cache: snapshot x not found"),
        (grpc.StatusCode.DATA_LOSS, errors.DataLoss, "cache: snapshot x not found"),
        (grpc.StatusCode.OUT_OF_RANGE, errors.InvalidArgument,
         "cache: OUT_OF_RANGE: snapshot x not found"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.Unavailable,
         "cache: DEADLINE_EXCEEDED: snapshot x not found"),
        (grpc.StatusCode.CANCELLED, errors.Unavailable, "cache: CANCELLED: snapshot x not found"),
        (grpc.StatusCode.INTERNAL, errors.Unavailable, "cache: INTERNAL: snapshot x not found"),
    ],
)
def test_status_becomes_domain_error(code: grpc.StatusCode, error: type[Exception],
                                     message: str) -> None:
    exc = rpc_errors.error_from_rpc(rpc_error(code, "snapshot x not found"), "cache")
    assert type(exc) is error and str(exc) == message
    assert exc.code == code.name  # what one class covers stays told apart


@pytest.mark.parametrize("error", [errors.InvalidArgument, errors.NotFound,
                                   errors.AlreadyExists, errors.ResourceExhausted,
                                   errors.FailedPrecondition, errors.Unavailable,
                                   errors.DataLoss])
def test_domain_errors_survive_the_round_trip(error: type[errors.KvstashError]) -> None:
    code = rpc_errors.status_for(error("boom"))
    assert type(rpc_errors.error_from_rpc(rpc_error(code, "boom"))) is error


class StalledCache(cache_pb2_grpc.KVCacheServicer):
    """Answers nothing: every call waits until its deadline."""

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await asyncio.sleep(3600)

    async def PutSnapshot(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await asyncio.sleep(3600)


async def test_each_call_takes_its_callers_timeout() -> None:
    server, port, _ = await rpc_server.create_server(
        "127.0.0.1:0", [lambda s: cache_pb2_grpc.add_KVCacheServicer_to_server(StalledCache(), s)],
        [])
    loop = asyncio.get_running_loop()
    layout = Layout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=64, dtype="float16")
    try:
        # No client-wide deadline: only the callers' bound these calls.
        async with CacheClient(f"127.0.0.1:{port}", timeout_s=None) as client:
            for call in (client.stats(timeout_s=0.3),
                         client.put("s", layout, 1, 1, bytes(4096), timeout_s=0.3)):
                started = loop.time()
                with pytest.raises(errors.Unavailable, match="DEADLINE_EXCEEDED"):
                    await call
                assert loop.time() - started < 3.0
        # The client's timeout_s is for calls given none.
        async with CacheClient(f"127.0.0.1:{port}", timeout_s=0.3) as client:
            with pytest.raises(errors.Unavailable, match="DEADLINE_EXCEEDED"):
                await asyncio.wait_for(client.stats(), 3.0)
    finally:
        await server.stop(None)


def _stream(*responses: bytes) -> grpc.RpcMethodHandler:
    return grpc.unary_stream_rpc_method_handler(lambda request, context: iter(responses))


def _unary(response: bytes) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(lambda request, context: response)


def _shared(reply: bytes) -> grpc.RpcMethodHandler:
    """A shared call that answers its first message with `reply`."""
    async def handler(requests: Any, context: Any) -> Any:
        messages = aiter(requests)
        await anext(messages)
        yield reply
        await anext(messages, None)  # the client's abandon, or its leaving

    return grpc.stream_stream_rpc_method_handler(handler)


UNDECODABLE = b"\x0a\xff\xff"  # a header field cut short
LAYOUT = make_layout("bfloat16")  # 32 KiB blocks
TOTAL = 4 * bytes_per_block(LAYOUT)


async def test_undecodable_get_response_is_a_domain_error(fake_cache) -> None:
    """grpc's client logs a response that does not decode and hands back
    None, which the client took for a header (AttributeError) or returned."""
    address = await fake_cache({"GetSnapshot": _stream(UNDECODABLE), "GetArena": _unary(b""),
                                "GetStats": _unary(UNDECODABLE)})
    async with CacheClient(address) as client:
        with pytest.raises(errors.DataLoss, match="did not decode"):
            await client.get_into("s", memoryview(bytearray(TOTAL)))
        with pytest.raises(errors.DataLoss, match="did not decode"):
            await client.stats()


@pytest.mark.parametrize(("header", "message"), [
    (make_header("s", LAYOUT, 4, chunk_bytes=0), "chunk_bytes is 0"),
    (make_header("s", LAYOUT, 4, total_bytes=1 << 40),
     "header of 1099511627776 bytes for 4 blocks of 32768"),
], ids=["chunk_bytes 0", "total_bytes not its blocks'"])
async def test_a_header_no_put_could_make_is_data_loss(fake_cache, header, message) -> None:
    """Not a division by zero, nor a buffer of whatever size it names."""
    response = cache_pb2.GetSnapshotResponse(header=header).SerializeToString()
    address = await fake_cache({"GetSnapshot": _stream(response), "GetArena": _unary(b"")})
    async with CacheClient(address) as client:
        with pytest.raises(errors.DataLoss, match=message):
            await client.get("s")


async def test_a_shared_reply_that_does_not_fit_the_snapshot_is_data_loss(
        fake_cache, tmp_path) -> None:
    arena = tmp_path / arena_file_name("x")
    arena.write_bytes(bytes(2 * TOTAL))
    arena.chmod(0o600)  # as the cache makes it
    info = cache_pb2.ArenaInfo(path=str(arena), size_bytes=2 * TOTAL, arena_id="x")
    long = cache_pb2.Extent(arena_id="x", offset=0, length=TOTAL + 1)
    cases = [
        ("PutShared", cache_pb2.PutSharedResponse(extent=long).SerializeToString(),
         f"extent of {TOTAL + 1} bytes for {TOTAL}"),
        ("PutShared", UNDECODABLE, "did not decode"),
        ("GetShared", cache_pb2.GetSharedResponse(
            header=make_header("s", LAYOUT, 4), extent=long).SerializeToString(),
         f"extent of {TOTAL + 1} bytes for {TOTAL}"),
    ]
    for method, reply, message in cases:
        address = await fake_cache({"GetArena": _unary(info.SerializeToString()),
                                    method: _shared(reply)})
        async with CacheClient(address) as client:
            with pytest.raises(errors.DataLoss, match=message):
                if method == "PutShared":
                    await client.put("s", LAYOUT, 4, 64, bytes(TOTAL))
                else:
                    await client.get_into("s", memoryview(bytearray(TOTAL)))


async def test_bad_arguments_are_invalid_argument_before_any_call() -> None:
    """Not protobuf's ValueError, which names no field."""
    async with CacheClient("127.0.0.1:1") as client:  # nothing listens: nothing is sent
        for call, name in [
            (client.put("s", LAYOUT, -1, 64, bytes(TOTAL)), "num_blocks is -1"),
            (client.put("s", LAYOUT, 4, 64, bytes(TOTAL), ttl_s=-5), "ttl_s is -5"),
            (client.put_shared("s", LAYOUT, 4, 1 << 32, TOTAL, None), "num_tokens is 4294967296"),
            (client.get_into("s", memoryview(bytearray(TOTAL)), start_chunk=-1),
             "start_chunk is -1"),
        ]:
            with pytest.raises(errors.InvalidArgument, match=name):
                await call
