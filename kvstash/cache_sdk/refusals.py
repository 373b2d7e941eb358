"""Calls the cache refused before processing any of them, and their retry.

A gRPC server refuses a stream beyond its MAX_CONCURRENT_STREAMS (the cache's
is cache_svc.config.MAX_STREAMS_PER_CONNECTION) with HTTP/2
RST_STREAM(REFUSED_STREAM), which HTTP/2 guarantees was not processed
(RFC 9113, 8.7). A client that keeps to the limit still meets it now and
then: the two ends count an ended stream as gone at different moments, and
gRPC shares one connection among the channels to an address, so many calls
at once (a scheduler offloading its victims) come close to the limit.
grpc-python reports the refusal as UNAVAILABLE, "... Received RST_STREAM with
error code 7"; a write that raced it fails instead with a local INTERNAL
("Internal error from Core") that hides the status. Such calls are tried
again (`retried`), a few times, within their deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from kvstash import errors
from kvstash.common import rpc_errors

T = TypeVar("T")

_REFUSED_DETAILS = "Received RST_STREAM with error code 7"  # REFUSED_STREAM
_LOCAL_FAILURE = "Internal error from Core"  # grpc-python's, for a failed batch
ATTEMPTS = 6
FIRST_BACKOFF_S = 0.005  # doubled after each refusal: 0.155 s in all


class Refused(errors.Unavailable):
    """The cache refused the call before processing any of it."""


def is_local_failure(exc: grpc.aio.AioRpcError) -> bool:
    """grpc-python failed a write of the call; its status came from no peer."""
    return exc.code() == grpc.StatusCode.INTERNAL and exc.details() == _LOCAL_FAILURE


def error_from_rpc(exc: grpc.aio.AioRpcError, unsent: bool = False) -> errors.KvstashError:
    """rpc_errors.error_from_rpc, as `Refused` for a refused stream. `unsent`:
    `exc` failed the call's first message, so the cache has none of it."""
    error = rpc_errors.error_from_rpc(exc, "cache")
    refused = (exc.code() == grpc.StatusCode.UNAVAILABLE
               and _REFUSED_DETAILS in (exc.details() or ""))
    if not (refused or (unsent and is_local_failure(exc))):
        return error
    refusal = Refused(f"{error} (the cache processed none of the call)")
    refusal.code = error.code
    return refusal


async def retried(attempt: Callable[[float | None], Awaitable[T]], timeout_s: float | None) -> T:
    """`attempt(timeout_s left)`, again while it raises Refused, at most
    ATTEMPTS times and while `timeout_s` (None = no deadline) allows."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    backoff_s = FIRST_BACKOFF_S
    for num_tries in range(1, ATTEMPTS + 1):
        left = None if deadline is None else deadline - loop.time()
        try:
            return await attempt(left)
        except Refused:
            out_of_time = deadline is not None and deadline - loop.time() <= 2 * backoff_s
            if num_tries == ATTEMPTS or out_of_time:
                raise
        await asyncio.sleep(backoff_s)
        backoff_s *= 2
    raise AssertionError("unreachable: the last attempt returns or raises")


async def unary(make_call: Callable[[float | None], Awaitable[T]], timeout_s: float | None,
                what: str = "cache") -> T:
    """A unary call, `make_call(timeout_s left)`, made as `retried` says; its
    failure as a kvstash error, its response checked (rpc_errors.decoded)."""

    async def attempt(left: float | None) -> T:
        try:
            response = await make_call(left)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        return rpc_errors.decoded(response, what)

    return await retried(attempt, timeout_s)
