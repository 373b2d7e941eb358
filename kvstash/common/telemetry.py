"""OpenTelemetry tracing for the three services: the only place that sets it up.

Contract
--------
Each service's entry point calls `setup_tracing(service_name)` once, before it
creates any gRPC server or channel, and `Tracing.shutdown()` once it has
stopped serving (this flushes spans still queued for export).

ON only when the standard variables ask for it:

    OTEL_SDK_DISABLED=true                     -> off, whatever else is set
    OTEL_EXPORTER_OTLP_ENDPOINT or
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set     -> on, OTLP/gRPC exporter
    OTEL_TRACES_EXPORTER=otlp / console        -> on, that exporter
    OTEL_TRACES_EXPORTER=none, or nothing set  -> off

Off: `setup_tracing` returns None having imported nothing of the SDK: no
provider, no instrumentation, no exporter thread. The OpenTelemetry API stays
the no-op it is by default, and the services check the returned handle (not
the API) before building any span data per step.

On: a TracerProvider whose Resource has service.name = `service_name`
("kvstash-scheduler", "kvstash-worker", "kvstash-cache") unless
OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES say otherwise; a
BatchSpanProcessor per exporter (the SDK reads endpoint, headers, timeouts,
OTEL_BSP_* and the sampler from OTEL_* itself); and grpc.aio server and client
instrumentation, so trace context travels in gRPC metadata:

    client --Generate--> scheduler --Offload/Restore--> worker --Put/GetSnapshot--> cache
           [root, or the      [kvstash.offload /           [client spans]         [server
            client's child]    kvstash.restore]                                   spans]

What is traced, so that one request is one trace and idle services send nothing:
  * servers: Generate and Abort of kvstash.v1.Scheduler and of
    vllm.grpc.engine.VllmEngine always (they start or join the caller's
    trace); any other method only when the caller sent trace
    context (a request's offload, restore, snapshot put and get). Background
    calls (cache stats polls, snapshot deletes, GetInfo) and health checks
    start no traces.
  * clients: only calls made inside a trace.
  * Worker.Execute, the step stream, is never instrumented: it lives as long
    as the process. Steps are not spans at all (a span per step would be a
    trace per step); each request's trace holds its phases in the scheduler
    instead: kvstash.queued, kvstash.prefill, kvstash.decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace

log = logging.getLogger(__name__)

SCHEDULER_SERVICE = "kvstash-scheduler"
WORKER_SERVICE = "kvstash-worker"
CACHE_SERVICE = "kvstash-cache"

# Methods that may start a trace of their own: the public request APIs, ours
# and vLLM's (what gateways such as smg call, with or without trace context).
_ROOT_METHODS = frozenset({
    "/kvstash.v1.Scheduler/Generate", "/kvstash.v1.Scheduler/Abort",
    "/vllm.grpc.engine.VllmEngine/Generate", "/vllm.grpc.engine.VllmEngine/Abort",
})
_UNTRACED_METHODS = frozenset({"/kvstash.v1.Worker/Execute"})
_TRUE = {"true", "1", "yes", "on"}
# Bounds the flush at stop: launchers SIGKILL a service that takes long to stop.
_FLUSH_TIMEOUT_MS = 5000


def tracing_requested(env: Mapping[str, str]) -> bool:
    """Whether the standard OTEL_* variables in `env` ask for traces."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False
    exporters = _exporter_names(env)
    if exporters:
        return exporters != ["none"]
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip())


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    raw = env.get("OTEL_TRACES_EXPORTER", "")
    return [name.strip().lower() for name in raw.split(",") if name.strip()]


@dataclass(slots=True)
class Tracing:
    """Handle to tracing that is on; `shutdown()` flushes and stops it."""

    provider: Any  # opentelemetry.sdk.trace.TracerProvider
    _instrumentors: tuple[Any, ...]

    def shutdown(self) -> None:
        """Exports what is queued (bounded by the exporter's timeouts), then
        stops the export thread and removes the gRPC instrumentation."""
        try:
            self.provider.force_flush(_FLUSH_TIMEOUT_MS)
            self.provider.shutdown()
        finally:
            for instrumentor in self._instrumentors:
                instrumentor.uninstrument()


def setup_tracing(
    service_name: str,
    env: Mapping[str, str] | None = None,
    exporter: Any = None,
) -> Tracing | None:
    """Turns tracing on when the OTEL_* variables ask for it; None when off.

    `env` (default os.environ) decides on or off; the SDK reads its own
    settings (endpoint, headers, sampler, OTEL_BSP_*, resource) from
    os.environ. `exporter` (a SpanExporter) replaces the ones the variables
    name and turns tracing on by itself unless OTEL_SDK_DISABLED; tests pass
    an in-memory one."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return None
    if exporter is None and not tracing_requested(env):
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Resource.create adds OTEL_RESOURCE_ATTRIBUTES, but lets the attributes
    # it is given win; the service name set there or in OTEL_SERVICE_NAME
    # must win over our default instead.
    configured = OTELResourceDetector().detect().attributes.get(SERVICE_NAME)
    resource = Resource.create({SERVICE_NAME: configured or service_name})
    provider = TracerProvider(resource=resource)
    exporters = [exporter] if exporter is not None else _exporters_from_env(env)
    for span_exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    instrumentors = _instrument_grpc()
    log.info("tracing on as %s, exporting to %s", service_name,
             ", ".join(type(e).__name__ for e in exporters))
    return Tracing(provider, instrumentors)


def _exporters_from_env(env: Mapping[str, str]) -> list[Any]:
    names = _exporter_names(env) or ["otlp"]
    exporters: list[Any] = []
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif name != "none":
            raise ValueError(f"OTEL_TRACES_EXPORTER names {name!r}; kvstash supports "
                             "otlp (gRPC), console and none")
    return exporters


@contextlib.contextmanager
def tracing_for(service_name: str) -> Iterator[Tracing | None]:
    """`setup_tracing` for a service's whole run, flushed and stopped at exit.

    Enter it before any gRPC server or channel exists: the instrumentation
    wraps their constructors."""
    tracing = setup_tracing(service_name)
    try:
        yield tracing
    finally:
        if tracing is not None:
            tracing.shutdown()


# -- gRPC instrumentation --------------------------------------------------


def _method(details: Any) -> str:
    method = details.method
    # grpc.aio hands clients bytes (grpc/grpc#31092).
    return method.decode() if isinstance(method, bytes) else str(method)


def _carries_trace(metadata: Any) -> bool:
    from opentelemetry import propagate

    carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
    ctx = propagate.extract(carrier)
    return trace.get_current_span(ctx).get_span_context().is_valid


def server_filter(details: Any) -> bool:
    """Server spans: the public request API always, anything else only as
    part of a trace the caller sent."""
    method = _method(details)
    if method in _ROOT_METHODS:
        return True
    if method in _UNTRACED_METHODS:
        return False
    return _carries_trace(details.invocation_metadata)


def client_filter(details: Any) -> bool:
    """Client spans: only for calls made inside a trace."""
    if _method(details) in _UNTRACED_METHODS:
        return False
    return trace.get_current_span().get_span_context().is_valid


def _instrument_grpc() -> tuple[Any, ...]:
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
    )
    from opentelemetry.instrumentation.grpc._aio_client import StreamUnaryAioClientInterceptor

    class AioClientInstrumentor(GrpcAioInstrumentorClient):  # type: ignore[misc]
        """The stock instrumentor, but with a stream-unary interceptor that
        works with the `call.write()` style CacheClient.put uses: the stock one
        awaits the call's status before handing the call back, so a writer
        waits for the end of a call that waits for its writes."""

        def _add_interceptors(self, tracer_provider: Any, kwargs: dict[str, Any]) -> Any:
            kwargs = super()._add_interceptors(tracer_provider, kwargs)
            kwargs["interceptors"] = [
                _StreamUnaryClientInterceptor(client_filter)
                if isinstance(i, StreamUnaryAioClientInterceptor) else i
                for i in kwargs["interceptors"]
            ]
            return kwargs

    server = GrpcAioInstrumentorServer(filter_=server_filter)
    client = AioClientInstrumentor(filter_=client_filter)
    server.instrument()
    client.instrument()
    return server, client


class _StreamUnaryClientInterceptor(grpc.aio.StreamUnaryClientInterceptor):
    """A client span around a stream-unary call, ended when the call is done;
    the call is handed back at once so the caller can write to it."""

    def __init__(self, filter_: Callable[[Any], bool]) -> None:
        self._filter = filter_
        self._tracer = trace.get_tracer("kvstash.common.telemetry")
        self._pending: set[asyncio.Task[None]] = set()

    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        if not self._filter(client_call_details):
            return await continuation(client_call_details, request_iterator)
        method = _method(client_call_details)
        service, _, name = method.lstrip("/").partition("/")
        # Named and attributed like the stock interceptors' spans.
        span = self._tracer.start_span(method, kind=trace.SpanKind.CLIENT, attributes={
            "rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
        from opentelemetry import propagate

        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        details = grpc.aio.ClientCallDetails(
            client_call_details.method, client_call_details.timeout,
            grpc.aio.Metadata(*(client_call_details.metadata or ()), *carrier.items()),
            client_call_details.credentials, client_call_details.wait_for_ready,
        )
        try:
            call = await continuation(details, request_iterator)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, str(exc))
            span.end()
            raise
        call.add_done_callback(lambda done: self._end_later(span, done))
        return call

    def _end_later(self, span: trace.Span, call: Any) -> None:
        # The status is only available to a coroutine; the call is done, so
        # it returns at once.
        task = asyncio.get_running_loop().create_task(self._end(span, call))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    @staticmethod
    async def _end(span: trace.Span, call: Any) -> None:
        try:
            code = await call.code()
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(trace.StatusCode.ERROR, f"{code.name}: {await call.details()}")
        finally:
            span.end()
