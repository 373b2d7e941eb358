"""How failures cross the gRPC edge: one domain error <-> status code table,
used both ways, so that no call of any service ends UNKNOWN.

    server side                               client side
    servicer raises errors.NotFound           error_from_rpc(exc) -> errors.NotFound
      -> @maps_errors -> NOT_FOUND    ------>   (its `code` names the status)
    servicer has a bug (KeyError)
      -> @maps_errors -> INTERNAL, logged  -->  errors.Unavailable
    request bytes do not decode
      -> DecodeErrorInterceptor -> INVALID_ARGUMENT
                                              response bytes do not decode
                                                -> None (grpc) -> decoded() -> errors.DataLoss

Every servicer method is wrapped by `maps_errors` (a test checks each RPC of
each service); every server built by kvstash.common.rpc_server installs
`DecodeErrorInterceptor`. A call ends once (`end_call`): the first status
sent stands, and one the call can no longer take (sent already, or its
client has left) only stops the handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from kvstash import errors

log = logging.getLogger(__name__)
T = TypeVar("T")

# Server side: the status each domain error is sent as (subclasses included).
_STATUS_FOR: dict[type[errors.KvstashError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
}
# Client side: the inverse, plus codes that grpc itself or a foreign peer
# produces. Any other code (INTERNAL, UNKNOWN, ...) means the peer failed, which
# callers treat like an unreachable one: Unavailable.
_ERROR_FOR: dict[grpc.StatusCode, type[errors.KvstashError]] = {
    **{code: cls for cls, code in _STATUS_FOR.items()},
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Unavailable,  # message says which
    grpc.StatusCode.CANCELLED: errors.Unavailable,
}


def error_from_rpc(exc: grpc.aio.AioRpcError, what: str = "") -> errors.KvstashError:
    """The domain error for a failed call, keeping the server's message.

    `what` ("cache", "generate") prefixes the message; the status name is
    added where the error class alone does not tell it."""
    code = exc.code()
    cls = _ERROR_FOR.get(code, errors.Unavailable)
    parts = [what] if what else []
    if _STATUS_FOR.get(cls) != code:
        parts.append(code.name)
    parts.append(exc.details() or "")
    error = cls(": ".join(parts))
    error.code = code.name
    return error


def status_for(exc: errors.KvstashError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _STATUS_FOR:
            return _STATUS_FOR[cls]
    return grpc.StatusCode.INTERNAL


async def end_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                   details: str) -> NoReturn:
    """Ends the call with this status, unless it has already ended: grpc
    allows one abort per call (a second raises "Abort already called!", which
    the caller would see as UNKNOWN). Raises grpc's AbortError once the status
    is sent; where it cannot be (the call has its status, or its client has
    left), raises CancelledError, which stops the handler as grpc stops one
    whose client cancelled, without another status."""
    if context.done():
        raise asyncio.CancelledError(f"call already ended; not sent: {code.name}: {details}")
    try:
        await context.abort(code, details)
    except grpc.aio.AbortError:
        raise
    except Exception as exc:
        # grpc marked the call aborted, then failed to send the status
        # (ExecuteBatchError): the client had already gone.
        raise asyncio.CancelledError(f"client gone; not sent: {code.name}: {details}") from exc
    raise AssertionError("unreachable: context.abort raises")


async def abort_with(context: grpc.aio.ServicerContext, exc: errors.KvstashError) -> NoReturn:
    await end_call(context, status_for(exc), str(exc))


async def _abort_for(context: grpc.aio.ServicerContext, exc: Exception, what: str) -> NoReturn:
    """Ends a call that `exc` broke: a domain error with its status, anything
    else (a bug) as INTERNAL naming `what` failed, logged with its traceback."""
    if isinstance(exc, errors.KvstashError):
        await abort_with(context, exc)
    log.error("%s failed", what, exc_info=exc)
    await end_call(context, grpc.StatusCode.INTERNAL,
                   f"{what} failed: {type(exc).__name__}: {str(exc)[:200]}")


def decoded(response: T | None, what: str) -> T:
    """`response`, unless grpc's client made it None, which it does (and logs)
    for a response that does not decode: then DataLoss naming `what`."""
    if response is None:
        raise errors.DataLoss(f"{what}: a response did not decode")
    return response


F = TypeVar("F", bound=Callable[..., Any])


def maps_errors(method: F) -> F:
    """Decorates an async servicer method, its response unary or streamed, so
    that whatever it raises ends the call as `_abort_for` says, never as grpc's
    UNKNOWN; a status it set with context.abort stands."""
    what = method.__qualname__
    if inspect.isasyncgenfunction(method):  # grpc tells a stream by its shape: keep it

        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:  # closed with the call, however it ends: its own `finally` runs now
                async with contextlib.aclosing(method(self, request, context)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort_for(context, exc, what)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_for(context, exc, what)

    return unary  # type: ignore[return-value]


class _Undecodable:
    """What a request deserializer yields for bytes it cannot decode."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # protobuf's DecodeError, or our codec's
            log.debug("undecodable request", exc_info=True)  # a codec bug shows here
            return _Undecodable(str(exc)[:200])

    return decode


async def _refuse(context: grpc.aio.ServicerContext, bad: _Undecodable) -> NoReturn:
    await end_call(context, grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {bad.reason}")


async def _checked(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    async for request in requests:
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        yield request


def _wrap_unary_in(behavior: Callable[..., Any]) -> Callable[..., Any]:
    # Keep the behavior's shape: grpc tells a response stream written with
    # `yield` from one written with `context.write` by it.
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            async for response in behavior(request, context):
                yield response

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        return await behavior(request, context)

    return unary


def _wrap_stream_in(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for response in behavior(_checked(requests, context), context):
                yield response

        return stream

    async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(_checked(requests, context), context)

    return unary


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request that does not decode (bad UTF-8 in a string field,
    garbage bytes) with INVALID_ARGUMENT and a plain message, on every method.

    Without it grpc sends UNKNOWN with a Python class name in the details.
    The deserializer is made tolerant (it returns a marker instead of
    raising) and the behavior refuses the marker; for streamed requests the
    marker is caught as the servicer reads the stream."""

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        changes: dict[str, Any] = {"request_deserializer": _tolerant(handler.request_deserializer)}
        for kind, wrap in (("unary_unary", _wrap_unary_in), ("unary_stream", _wrap_unary_in),
                           ("stream_unary", _wrap_stream_in), ("stream_stream", _wrap_stream_in)):
            behavior = getattr(handler, kind)
            if behavior is not None:
                changes[kind] = wrap(behavior)
        return handler._replace(**changes)
