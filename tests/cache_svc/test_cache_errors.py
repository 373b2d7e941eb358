"""What a failed cache call raises: one status <-> error mapping
(kvstash.common.rpc_errors) for the cache server, the cache client and the
worker in between."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common import rpc_errors, rpc_server
from kvstash.common.layout import Layout
from kvstash.v1 import cache_pb2_grpc


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
