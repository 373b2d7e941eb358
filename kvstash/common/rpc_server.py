"""A service's gRPC server, from start to stop, the same for every service.

`create_server` binds (port 0 works, for tests) and always adds the standard
health service and server reflection, so `grpcurl` and Kubernetes gRPC probes
work against every service; it installs the connection limits
(kvstash.common.rpc_connections), bearer-token checks (kvstash.common.security)
and the refusal of undecodable requests (kvstash.common.rpc_errors), and
refuses an address another process listens on (kvstash.common.binding:
BindError, never a shared port). A
service's `__main__` then announces where it listens (`announce_ready`) and
serves until signalled (`run_until_signalled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstash.common.bearer import TokenAuth
from kvstash.common.binding import NO_REUSEPORT, BindError, check_free, split_address
from kvstash.common.rpc_connections import CHANNEL_OPTIONS, DEFAULT_CONNECTIONS, Connections
from kvstash.common.rpc_errors import DecodeErrorInterceptor
from kvstash.common.security import PLAINTEXT, Security, check_listen

log = logging.getLogger(__name__)

Registrar = Callable[[grpc.aio.Server], None]


class HealthServicer(health.aio.HealthServicer):  # type: ignore[misc]
    """grpcio's health service, plus the List its aio servicer lacks (1.85
    answers UNIMPLEMENTED, though reflection advertises the method)."""

    async def List(  # noqa: N802 (the gRPC method's name)
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        """Every service Check knows, with the status Check would answer now."""
        # grpcio keeps the statuses Check reads in this map (set() and graceful
        # shutdown write it); reading it keeps List and Check from disagreeing.
        statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in statuses.items()})


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
) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """Builds and starts a server on `address` ("host:port", port 0 = any free).

    Returns the server, the bound port and its health servicer: all services
    report SERVING once started, or NOT_SERVING unless `serving` (a service
    that is not ready yet); flip them with `health.set`. Beyond
    `maximum_concurrent_rpcs` calls at once, gRPC answers RESOURCE_EXHAUSTED.
    `security`: TLS, tokens, and whether plaintext may leave loopback
    (ValueError if it may not); `connections`: keepalive, idle and stream
    limits per connection (flags beat a service's own `options`). BindError
    (one line naming `address`) if another process listens there or it
    cannot be bound, before anything starts."""
    check_listen(address, security)
    try:
        host, port = split_address(address)
    except ValueError as exc:  # e.g. a port past 65535, which gRPC would wrap around
        raise BindError(f"cannot listen on {address}: {exc}") from None
    check_free(host, port)
    # The port is this server's alone, whatever `options` say (see binding).
    merged = (dict(CHANNEL_OPTIONS) | dict(options) | dict(connections.server_options())
              | dict([NO_REUSEPORT]))
    auth = [TokenAuth(security.tokens, security.token_file)] if security.tokens else []
    server = grpc.aio.server(
        options=list(merged.items()),
        interceptors=[*auth, *interceptors, DecodeErrorInterceptor()],
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
    )
    for register in registrars:
        register(server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    try:
        if security.tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, security.tls.server_credentials())
    except RuntimeError:  # gRPC's "Failed to bind": taken since the check, or not ours
        port = 0
    if port == 0:
        await server.stop(None)  # else it complains, unstarted, when collected
        raise BindError(f"cannot listen on {address} (in use, or not an address of this "
                        "host)")
    try:
        await server.start()
        await set_serving(health_servicer, names, serving)
    except BaseException:  # cancelled (Ctrl-C) as it started: stopped, for the same reason
        await server.stop(None)
        raise
    return server, port, health_servicer


async def set_serving(
    health_servicer: HealthServicer, service_names: Iterable[str], serving: bool
) -> None:
    """What health checks answer for the server ("") and each named service."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", *service_names):
        await health_servicer.set(name, status)


# A service's exit status when SIGINT (Ctrl-C) cut its start short: 128 + 2,
# as a shell reports a process SIGINT ended. Once serving, it stops gracefully.
INTERRUPTED_EXIT = 130


@contextlib.contextmanager
def signals_wake_the_loop() -> Iterator[None]:
    """While a service starts (asyncio.run's own SIGINT handler raising
    KeyboardInterrupt), any signal wakes the event loop. Python runs a
    handler in the main thread, and wakes that thread only through a wakeup
    fd, which asyncio sets only for add_signal_handler: a Ctrl-C the kernel
    delivered to another thread (the one loading a model) waited for the
    loop's next event: for a worker loading its model, until the load ended.
    Once serving, run_until_signalled's handlers set the loop's own."""
    loop = asyncio.get_running_loop()
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    loop.add_reader(reader.fileno(), reader.recv, 4096)
    old = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    try:
        yield
    finally:
        current = signal.set_wakeup_fd(old)
        if current != writer.fileno():  # set since (add_signal_handler): kept
            signal.set_wakeup_fd(current)
        loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()


async def run_until_signalled(
    server: grpc.aio.Server,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 5.0,
    until: Awaitable[object] | None = None,
) -> None:
    """Serves until SIGINT/SIGTERM (or `until` completes), then stops
    gracefully: in-flight calls get `grace_s` seconds to finish."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.ensure_future(server.wait_for_termination()),
             asyncio.ensure_future(stop.wait())]
    if until is not None:
        tasks.append(asyncio.ensure_future(until))
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down")
    await server.stop(grace_s)  # refuse new calls, let running ones finish
    if on_stop is not None:
        await on_stop()
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --log-level's choices, each service's.
LOG_LEVELS = ("debug", "info", "warning", "error")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


READY_MARKER = "KVSTASH_READY"


def announce_ready(service: str, host: str, port: int) -> None:
    """Prints the one line launchers wait for: `KVSTASH_READY <service> <host>:<port>`.

    Services started with port 0 are found this way (by `kvstash up` and tests)."""
    print(f"{READY_MARKER} {service} {host}:{port}", flush=True)
