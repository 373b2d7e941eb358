"""What a failed cache call raises: one status <-> error mapping (kvstash.rpc)
for the cache server, the cache client and the worker in between."""

from __future__ import annotations

import grpc
import pytest

from kvstash import errors, rpc


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
    exc = rpc.error_from_rpc(rpc_error(code, "snapshot x not found"), "cache")
    assert type(exc) is error and str(exc) == message


@pytest.mark.parametrize("error", [errors.InvalidArgument, errors.NotFound,
                                   errors.AlreadyExists, errors.ResourceExhausted,
                                   errors.FailedPrecondition, errors.Unavailable,
                                   errors.DataLoss])
def test_domain_errors_survive_the_round_trip(error: type[errors.KvstashError]) -> None:
    code = rpc.status_for(error("boom"))
    assert type(rpc.error_from_rpc(rpc_error(code, "boom"))) is error
