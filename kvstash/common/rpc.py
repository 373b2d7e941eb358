"""gRPC plumbing shared by all services: servers, channels, error mapping.

`create_server` binds (port 0 works, for tests) and always adds the standard
health service and server reflection, so `grpcurl` and Kubernetes gRPC probes
work against every service.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstash import errors
from kvstash.common.security import PLAINTEXT, Security, TokenAuth, channel_args, check_listen
from kvstash.common.units import MIB, parse_duration

log = logging.getLogger(__name__)

# Snapshot chunks are at most 4 MiB of payload; leave room for framing.
MAX_MESSAGE_BYTES = 8 * MIB
# A worker's GetInfo carries the model's tokenizer.json (Llama 3's is ~9 MB):
# the worker may send, and its scheduler receive, this much.
MAX_WORKER_INFO_BYTES = 64 * MIB
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Bulk KV transfers want a large flow-control window from the start.
    ("grpc.http2.lookahead_bytes", 4 * MIB),
]

# Clients find a dead server within ~80 s (a ping after 60 s of silence, 20 s
# to answer) instead of when the kernel gives up on the socket.
KEEPALIVE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
]


@dataclass(frozen=True, slots=True)
class Connections:
    """What every server allows one client connection (`add_connection_flags`)."""

    keepalive_s: float = 60.0  # ping a silent client after this long...
    keepalive_timeout_s: float = 20.0  # ...and drop it without an answer in this
    idle_s: float = 600.0  # close a connection without calls this long (clients reconnect)
    max_streams: int = 0  # calls open at once per connection; 0 = the service's default

    def __post_init__(self) -> None:
        for name in ("keepalive_s", "keepalive_timeout_s", "idle_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} is {getattr(self, name)}, must be > 0")
        if self.max_streams < 0:
            raise ValueError(f"max_streams is {self.max_streams}, must be >= 0")

    def server_options(self) -> list[tuple[str, Any]]:
        options = [
            ("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            # Clients ping every 60 s (KEEPALIVE_OPTIONS); faster is abuse.
            ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
            ("grpc.max_connection_idle_ms", int(self.idle_s * 1000)),
        ]
        if self.max_streams:
            options.append(("grpc.max_concurrent_streams", self.max_streams))
        return options


DEFAULT_CONNECTIONS = Connections()


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    d = DEFAULT_CONNECTIONS
    group = parser.add_argument_group("connections")
    group.add_argument("--keepalive", type=_duration, default=d.keepalive_s,
                       help="ping a client silent this long (e.g. 60s)")
    group.add_argument("--keepalive-timeout", type=_duration, default=d.keepalive_timeout_s,
                       help="drop a client that does not answer a ping within this")
    group.add_argument("--idle-timeout", type=_duration, default=d.idle_s,
                       help="close a connection without calls this long (e.g. 10m)")
    group.add_argument("--max-streams-per-connection", type=int, default=d.max_streams,
                       help="calls open at once on one connection; more wait on the client's "
                            "side; 0 = this service's default")


def connections_from_args(args: argparse.Namespace) -> Connections:
    return Connections(args.keepalive, args.keepalive_timeout, args.idle_timeout,
                       args.max_streams_per_connection)


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


async def abort_with(context: grpc.aio.ServicerContext, exc: errors.KvstashError) -> NoReturn:
    await context.abort(status_for(exc), str(exc))
    raise AssertionError("unreachable: context.abort raises")


async def _abort_for(context: grpc.aio.ServicerContext, exc: Exception, what: str) -> NoReturn:
    """Ends a call that `exc` broke: a domain error with its status, anything
    else (a bug) as INTERNAL naming `what` failed, logged with its traceback."""
    if isinstance(exc, errors.KvstashError):
        await abort_with(context, exc)
    log.error("%s failed", what, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"{what} failed: {type(exc).__name__}: {str(exc)[:200]}")
    raise AssertionError("unreachable: context.abort raises")


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
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {bad.reason}")
    raise AssertionError("unreachable: context.abort raises")


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


Registrar = Callable[[grpc.aio.Server], None]


async def create_server(
    address: str,
    registrars: Iterable[Registrar],
    service_names: Iterable[str],
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    options: Iterable[tuple[str, Any]] = (),
    serving: bool = True,
    maximum_concurrent_rpcs: int | None = None,
    security: Security = PLAINTEXT,
    connections: Connections = DEFAULT_CONNECTIONS,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Builds and starts a server on `address` ("host:port", port 0 = any free).

    Returns the server, the bound port and its health servicer: all services
    report SERVING once started, or NOT_SERVING unless `serving` (a service
    that is not ready yet); flip them with `health.set`. Beyond
    `maximum_concurrent_rpcs` calls at once, gRPC answers RESOURCE_EXHAUSTED.
    `security`: TLS, tokens, and whether plaintext may leave loopback
    (ValueError if it may not); `connections`: keepalive, idle and stream
    limits per connection (flags beat a service's own `options`)."""
    check_listen(address, security)
    merged = dict(CHANNEL_OPTIONS) | dict(options) | dict(connections.server_options())
    auth = [TokenAuth(security.tokens)] if security.tokens else []
    server = grpc.aio.server(
        options=list(merged.items()),
        interceptors=[*auth, *interceptors, DecodeErrorInterceptor()],
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
    )
    for register in registrars:
        register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    if security.tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, security.tls.server_credentials())
    if port == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    await set_serving(health_servicer, names, serving)
    return server, port, health_servicer


async def set_serving(
    health_servicer: health.aio.HealthServicer, service_names: Iterable[str], serving: bool
) -> None:
    """What health checks answer for the server ("") and each named service."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", *service_names):
        await health_servicer.set(name, status)


def channel(address: str, security: Security = PLAINTEXT,
            options: Iterable[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A client channel: TLS (with this process's certificate, for mutual
    TLS) and the bearer token as `security` says."""
    merged = list((dict(CHANNEL_OPTIONS) | dict(KEEPALIVE_OPTIONS) | dict(options)).items())
    extra = channel_args(security)
    if extra["credentials"] is None:
        return grpc.aio.insecure_channel(address, options=merged,
                                         interceptors=extra["interceptors"])
    return grpc.aio.secure_channel(address, extra["credentials"], options=merged,
                                   interceptors=extra["interceptors"])


def insecure_channel(address: str) -> grpc.aio.Channel:
    return channel(address)


async def run_until_signalled(
    server: grpc.aio.Server,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 5.0,
) -> None:
    """Serves until SIGINT/SIGTERM, then stops gracefully: in-flight calls get
    `grace_s` seconds to finish."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(server.wait_for_termination())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down")
    await server.stop(grace_s)  # refuse new calls, let running ones finish
    if on_stop is not None:
        await on_stop()
    for task in (waiter, stopper):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


READY_MARKER = "KVSTASH_READY"


def announce_ready(service: str, host: str, port: int) -> None:
    """Prints the one line launchers wait for: `KVSTASH_READY <service> <host>:<port>`.

    Services started with port 0 are found this way (by `kvstash up` and tests)."""
    print(f"{READY_MARKER} {service} {host}:{port}", flush=True)
