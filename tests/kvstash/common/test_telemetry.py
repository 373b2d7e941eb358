"""kvstash.common.telemetry: off unless the OTEL_* variables ask; on, gRPC calls made
inside a trace carry it to the server, write-style streaming calls included."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from kvstash.common import telemetry

PUT = "/test.Echo/Put"  # stream-unary, like KVCache/PutSnapshot
GET = "/test.Echo/Get"  # unary-unary


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False),
    ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, False),
])
def test_tracing_requested_follows_the_standard_variables(env: dict[str, str], on: bool) -> None:
    assert telemetry.tracing_requested(env) is on


def test_disabled_sdk_wins_over_an_explicit_exporter() -> None:
    env = {"OTEL_SDK_DISABLED": "true"}
    assert telemetry.setup_tracing("svc", env=env, exporter=InMemorySpanExporter()) is None


def test_unknown_exporter_is_refused() -> None:
    with pytest.raises(ValueError, match="zipkin"):
        telemetry.setup_tracing("svc", env={"OTEL_TRACES_EXPORTER": "zipkin"})


def test_off_by_default_installs_nothing() -> None:
    """In a fresh process with no OTEL_* variables: no SDK import, no provider,
    no instrumentation, no extra thread."""
    code = (
        "import sys, threading, grpc\n"
        "from opentelemetry import trace\n"
        "from kvstash.common import telemetry\n"
        "server, channel = grpc.aio.server, grpc.aio.insecure_channel\n"
        "assert telemetry.setup_tracing(telemetry.SCHEDULER_SERVICE) is None\n"
        "assert not any(m.startswith('opentelemetry.sdk') for m in sys.modules)\n"
        "assert not any(m.startswith('opentelemetry.instrumentation') for m in sys.modules)\n"
        "assert type(trace.get_tracer_provider()).__name__ == 'ProxyTracerProvider'\n"
        "assert grpc.aio.server is server and grpc.aio.insecure_channel is channel\n"
        "assert threading.active_count() == 1\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def _reset_global_provider() -> None:
    # The API allows one provider per process; tests need a fresh one each.
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


@pytest.fixture
def tracing(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[telemetry.Tracing,
                                                               InMemorySpanExporter]]:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "renamed")
    _reset_global_provider()
    exporter = InMemorySpanExporter()
    handle = telemetry.setup_tracing(telemetry.CACHE_SERVICE, env={}, exporter=exporter)
    assert handle is not None
    try:
        yield handle, exporter
    finally:
        handle.shutdown()
        _reset_global_provider()


async def _put(request_iterator: AsyncIterator[bytes], context: object) -> bytes:
    return b"".join([chunk async for chunk in request_iterator])


async def _get(request: bytes, context: object) -> bytes:
    return request


async def test_calls_inside_a_trace_carry_it_to_the_server(
    tracing: tuple[telemetry.Tracing, InMemorySpanExporter],
) -> None:
    handle, exporter = tracing
    server = grpc.aio.server()  # instrumented: created after setup_tracing
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {
        "Put": grpc.stream_unary_rpc_method_handler(_put),
        "Get": grpc.unary_unary_rpc_method_handler(_get),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            put = channel.stream_unary(PUT)
            get = channel.unary_unary(GET)
            assert await get(b"untraced", timeout=5) == b"untraced"
            with trace.get_tracer(__name__).start_as_current_span("request"):
                # Written chunk by chunk, as CacheClient.put does: the stock
                # stream-unary interceptor would hold the writes until the
                # deadline.
                call = put(timeout=5)
                for chunk in (b"a", b"b", b"c"):
                    await call.write(chunk)
                await call.done_writing()
                assert await call == b"abc"
                assert await get(b"traced", timeout=5) == b"traced"
    finally:
        await server.stop(None)
    handle.provider.force_flush()
    spans = exporter.get_finished_spans()

    assert {s.resource.attributes["service.name"] for s in spans} == {"renamed"}
    names = sorted((s.name, s.kind.name) for s in spans)
    # The untraced call made no spans: nothing on the client outside a trace,
    # nothing on the server without context (Get is no public entry point).
    assert names == sorted([("request", "INTERNAL"), (PUT, "CLIENT"), (PUT, "SERVER"),
                            (GET, "CLIENT"), (GET, "SERVER")])
    root = next(s for s in spans if s.name == "request")
    assert root.context is not None
    assert {s.context.trace_id for s in spans if s.context is not None} == {root.context.trace_id}
    by_id = {s.context.span_id: s for s in spans if s.context is not None}
    for name in (PUT, GET):
        client = next(s for s in spans if s.name == name and s.kind.name == "CLIENT")
        server_span = next(s for s in spans if s.name == name and s.kind.name == "SERVER")
        assert client.parent is not None and by_id[client.parent.span_id] is root
        assert server_span.parent is not None
        assert by_id[server_span.parent.span_id] is client
    put_client = next(s for s in spans if s.name == PUT and s.kind.name == "CLIENT")
    assert put_client.attributes is not None
    assert put_client.attributes["rpc.grpc.status_code"] == 0


async def test_shutdown_removes_the_instrumentation(monkeypatch: pytest.MonkeyPatch) -> None:
    _reset_global_provider()
    server, channel = grpc.aio.server, grpc.aio.insecure_channel
    handle = telemetry.setup_tracing("svc", env={}, exporter=InMemorySpanExporter())
    assert handle is not None
    try:
        assert grpc.aio.insecure_channel is not channel
    finally:
        handle.shutdown()
        _reset_global_provider()
    assert grpc.aio.server is server and grpc.aio.insecure_channel is channel


async def _stream(request: bytes, context: object) -> AsyncIterator[bytes]:
    yield request


async def test_generate_and_abort_of_both_public_apis_start_traces(
    tracing: tuple[telemetry.Tracing, InMemorySpanExporter],
) -> None:
    """A gateway that sends no trace context (smg) calls VllmEngine: its
    Generate must still be a trace's root, or the request's phase and copy
    spans, whose parent it is, become one root trace each."""
    handle, exporter = tracing
    server = grpc.aio.server()
    for service in ("kvstash.v1.Scheduler", "vllm.grpc.engine.VllmEngine"):
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {
            "Generate": grpc.unary_stream_rpc_method_handler(_stream),
            "Abort": grpc.unary_unary_rpc_method_handler(_get),
            "GetLoads": grpc.unary_unary_rpc_method_handler(_get),
        })])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    roots = [f"/{service}/{method}" for service in ("kvstash.v1.Scheduler",
                                                     "vllm.grpc.engine.VllmEngine")
             for method in ("Generate", "Abort")]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method in roots:
                if method.endswith("Generate"):
                    assert [m async for m in channel.unary_stream(method)(b"x", timeout=5)] == [
                        b"x"]
                else:
                    assert await channel.unary_unary(method)(b"x", timeout=5) == b"x"
            # Neither API's other methods start one (smg polls GetLoads).
            await channel.unary_unary("/vllm.grpc.engine.VllmEngine/GetLoads")(b"x", timeout=5)
    finally:
        await server.stop(None)
    handle.provider.force_flush()
    spans = exporter.get_finished_spans()
    assert sorted((s.name, s.kind.name) for s in spans) == sorted(
        (method, "SERVER") for method in roots)
    assert all(s.parent is None for s in spans)
