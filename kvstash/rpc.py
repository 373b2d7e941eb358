"""gRPC plumbing shared by all services: servers, channels, error mapping.

`create_server` binds (port 0 works, for tests) and always adds the standard
health service and server reflection, so `grpcurl` and Kubernetes gRPC probes
work against every service.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstash import errors

log = logging.getLogger(__name__)

MIB = 1 << 20
# Snapshot chunks are at most 4 MiB of payload; leave room for framing.
MAX_MESSAGE_BYTES = 8 * MIB
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Bulk KV transfers want a large flow-control window from the start.
    ("grpc.http2.lookahead_bytes", 4 * MIB),
]

# Server side: the status each domain error is sent as (subclasses included).
_STATUS_FOR: dict[type[errors.KvstashError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
}
# Client side: the inverse, plus codes that grpc itself or a foreign peer
# produces. Any other code (INTERNAL, UNKNOWN, ...) means the peer failed, which
# callers treat like an unreachable one: Unavailable.
_ERROR_FOR: dict[grpc.StatusCode, type[errors.KvstashError]] = {
    **{code: cls for cls, code in _STATUS_FOR.items()},
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Unavailable,
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
    return cls(": ".join(parts))


def status_for(exc: errors.KvstashError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _STATUS_FOR:
            return _STATUS_FOR[cls]
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: errors.KvstashError) -> NoReturn:
    await context.abort(status_for(exc), str(exc))
    raise AssertionError("unreachable: context.abort raises")


F = TypeVar("F", bound=Callable[..., Any])


def maps_errors(method: F) -> F:
    """Decorates a unary (or client-streaming) async servicer method so that
    domain errors become the matching gRPC status instead of UNKNOWN."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except errors.KvstashError as exc:
            await abort_with(context, exc)

    return wrapper  # type: ignore[return-value]


Registrar = Callable[[grpc.aio.Server], None]


async def create_server(
    address: str,
    registrars: Iterable[Registrar],
    service_names: Iterable[str],
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    options: Iterable[tuple[str, Any]] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Builds and starts a server on `address` ("host:port", port 0 = any free).

    Returns the server, the bound port and its health servicer (all services
    report SERVING once started; flip them with `health.set`)."""
    server = grpc.aio.server(
        options=[*CHANNEL_OPTIONS, *options], interceptors=list(interceptors)
    )
    for register in registrars:
        register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


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


def parse_bytes(text: str) -> int:
    """"8GiB", "512MiB", "1.5G", "4096" -> bytes. Raises ValueError naming the input."""
    units = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    num, unit = (s[:-1], s[-1]) if s and s[-1] in "kmgt" else (s, "")
    try:
        value = float(num) * units[unit]
    except ValueError:
        raise ValueError(f"not a byte size: {text!r} (try 512MiB, 8GiB)") from None
    if value < 0:
        raise ValueError(f"byte size must not be negative: {text!r}")
    return int(value)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


READY_MARKER = "KVSTASH_READY"


def announce_ready(service: str, host: str, port: int) -> None:
    """Prints the one line launchers wait for: `KVSTASH_READY <service> <host>:<port>`.

    Services started with port 0 are found this way (by `kvstash up` and tests)."""
    print(f"{READY_MARKER} {service} {host}:{port}", flush=True)
