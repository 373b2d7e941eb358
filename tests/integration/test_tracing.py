"""Tracing end to end: three service processes export to an OTLP receiver run
by the test, and one request's trace spans all of them, offload and restore
included."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from kvstash.client import Client
from kvstash.common import telemetry
from kvstash.launch.stack import StackConfig, arena_args, running_stack
from tests.integration.workload import (
    PRESSURED_BLOCKS,
    PRESSURED_SCHEDULER_ARGS,
    expected_outputs,
    prompts,
    run_workload,
)

GENERATE = "/kvstash.v1.Scheduler/Generate"
OFFLOAD = "/kvstash.v1.Worker/Offload"
RESTORE = "/kvstash.v1.Worker/Restore"
RESERVE = "/kvstash.v1.Scheduler/ReserveBlocks"
DECODE = "/kvstash.v1.Scheduler/Decode"
# The worker moves KV through the cache's arena where the stack gives the
# cache one (where /dev/shm has room), else streams it; either way the cache
# call joins the request's trace on both sides.
SHARED = bool(arena_args(StackConfig()))
PUT = "/kvstash.v1.KVCache/" + ("PutShared" if SHARED else "PutSnapshot")
GET = "/kvstash.v1.KVCache/" + ("GetShared" if SHARED else "GetSnapshot")
SERVER = trace_pb2.Span.SpanKind.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SpanKind.SPAN_KIND_CLIENT
INTERNAL = trace_pb2.Span.SpanKind.SPAN_KIND_INTERNAL
PHASES = ("kvstash.queued", "kvstash.prefill", "kvstash.decode")


@dataclass(frozen=True, slots=True)
class SeenSpan:
    service: str
    name: str
    kind: int
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes


@dataclass(slots=True)
class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """The OTLP/gRPC trace endpoint of a collector, keeping what it gets."""

    spans: list[SeenSpan] = field(default_factory=list)

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(
                    SeenSpan(service, s.name, s.kind, s.trace_id, s.span_id, s.parent_span_id)
                    for s in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
async def receiver(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Receiver]:
    receiver = Receiver()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # The services inherit the test's environment.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME",
                 "OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield receiver
    finally:
        await server.stop(None)


async def test_one_trace_per_request_across_all_services(
    receiver: Receiver, tmp_path: Path
) -> None:
    config = StackConfig(num_blocks=PRESSURED_BLOCKS, preemption_mode="offload",
                         scheduler_args=PRESSURED_SCHEDULER_ARGS)
    with running_stack(config, tmp_path) as stack:
        outcome = await run_workload(stack.address)
        # Stopping the stack (in a thread: this loop serves the receiver) must
        # flush every service's queued spans.
        await asyncio.to_thread(stack.stop)
    assert [r.token_ids for r in outcome.results] == expected_outputs()
    # Tracing must not change what happens: every preempted request resumes
    # from its snapshot (the cache's streamed GetSnapshot works under the
    # server instrumentation), none is recomputed.
    stats = outcome.stats
    assert stats.num_preemptions_offload > 0
    assert stats.num_restore_failures == 0
    assert stats.num_offload_failures == 0
    assert stats.num_recomputed_tokens == 0
    assert stats.bytes_restored > 0

    spans = receiver.spans
    assert {s.service for s in spans} >= {
        telemetry.SCHEDULER_SERVICE, telemetry.WORKER_SERVICE, telemetry.CACHE_SERVICE}
    by_trace: dict[bytes, list[SeenSpan]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)

    def has(trace: list[SeenSpan], service: str, name: str, kind: int) -> bool:
        return any(s.service == service and s.name == name and s.kind == kind for s in trace)

    def has_call(trace: list[SeenSpan], name: str) -> bool:
        """A cache call on both sides: the worker's client span, the cache's server span."""
        return (has(trace, telemetry.WORKER_SERVICE, name, CLIENT)
                and has(trace, telemetry.CACHE_SERVICE, name, SERVER))

    generate_traces = [t for t in by_trace.values()
                       if has(t, telemetry.SCHEDULER_SERVICE, GENERATE, SERVER)]
    # One trace per request, each rooted at its Generate span (the test's client
    # is not instrumented).
    assert len(generate_traces) == len(outcome.results)
    for t in generate_traces:
        roots = [s for s in t if not s.parent_span_id]
        assert [(r.service, r.name) for r in roots] == [(telemetry.SCHEDULER_SERVICE, GENERATE)]

    offloaded = [t for t in generate_traces
                 if has(t, telemetry.SCHEDULER_SERVICE, "kvstash.offload", INTERNAL)
                 and has(t, telemetry.WORKER_SERVICE, OFFLOAD, SERVER)
                 and has_call(t, PUT)]
    assert offloaded, "no request trace holds its offload on all three services"
    restored = [t for t in offloaded
                if has(t, telemetry.SCHEDULER_SERVICE, "kvstash.restore", INTERNAL)
                and has(t, telemetry.WORKER_SERVICE, RESTORE, SERVER)
                and has_call(t, GET)]
    assert restored, "no request trace holds its restore on all three services"
    # Every span of a request's trace hangs off another span of that trace.
    for t in generate_traces:
        ids = {s.span_id for s in t}
        assert all(not s.parent_span_id or s.parent_span_id in ids for s in t)

    # Each request's phases in the scheduler are spans of its own trace.
    for t in generate_traces:
        phases = [s.name for s in t if s.name in PHASES]
        assert sorted(phases) == sorted(PHASES), phases
    # No trace but the requests': steps start none (they would be hundreds of
    # one-span traces), nor do background calls (cache stats polls, snapshot
    # deletes, GetInfo, health).
    roots = {s.name for s in spans if not s.parent_span_id}
    assert roots == {GENERATE}
    assert len(by_trace) == len(outcome.results)


async def test_one_trace_spans_both_pd_instances(receiver: Receiver, tmp_path: Path) -> None:
    """P/D: each request's trace holds its reservation and its decode on the
    decode instance, the handoff put on the prefill side and the restore on
    the decode side, all under the client's one Generate span."""
    with running_stack(StackConfig(pd=True), tmp_path) as stack:
        async with Client(stack.address) as client:
            results = await asyncio.gather(*[
                client.complete(p, max_tokens=12, ignore_eos=True) for p in prompts()[:4]])
        assert stack.decode_scheduler is not None
        async with Client(stack.decode_scheduler.address) as decode_client:
            decode = await decode_client.stats()
        await asyncio.to_thread(stack.stop)
    assert [r.token_ids for r in results] == [e[:12] for e in expected_outputs()[:4]]
    assert decode.num_restore_failures == 0
    by_trace: dict[bytes, list[SeenSpan]] = defaultdict(list)
    for s in receiver.spans:
        by_trace[s.trace_id].append(s)
    assert len(by_trace) == len(results)  # one trace per request, nothing else
    for t in by_trace.values():
        names = {(s.name, s.kind) for s in t}
        assert {(GENERATE, SERVER), (RESERVE, CLIENT), (RESERVE, SERVER),
                ("kvstash.handoff", INTERNAL), (OFFLOAD, SERVER), (DECODE, CLIENT),
                (DECODE, SERVER), ("kvstash.restore", INTERNAL), (RESTORE, SERVER)} <= names
        roots = [s for s in t if not s.parent_span_id]
        assert [(r.name, r.kind) for r in roots] == [(GENERATE, SERVER)]
        ids = {s.span_id for s in t}
        assert all(not s.parent_span_id or s.parent_span_id in ids for s in t)


async def test_a_prompt_from_the_prefix_tier_shows_its_lookup_save_and_load(
    receiver: Receiver, tmp_path: Path
) -> None:
    config = StackConfig(instances=2, scheduler_args=("--prefix-segment-tokens", "32"))
    prompt = [(7 * j + 3) % 256 for j in range(70)]  # 2 segments
    with running_stack(config, tmp_path) as stack:
        first, second = stack.addresses
        for address in (first, second):
            async with Client(address) as client:
                await client.complete(prompt, max_tokens=4, ignore_eos=True)
                # The first one's saves land before the second one looks.
                while (await client.stats()).num_tier_saves < 2 and address == first:
                    await asyncio.sleep(0.05)
        await asyncio.to_thread(stack.stop)
    traces: dict[bytes, set[tuple[str, str]]] = defaultdict(set)
    for s in receiver.spans:
        traces[s.trace_id].add((s.service, s.name))
    requests = [t for t in traces.values() if (telemetry.SCHEDULER_SERVICE, GENERATE) in t]
    assert len(requests) == 2 and len(traces) == 2  # saves and loads join them
    saved, loaded = sorted(requests, key=lambda t: (telemetry.WORKER_SERVICE, RESTORE) in t)
    scheduler, worker = telemetry.SCHEDULER_SERVICE, telemetry.WORKER_SERVICE
    assert {(scheduler, "kvstash.prefix_lookup"), (scheduler, "kvstash.prefix_save"),
            (worker, OFFLOAD), (telemetry.CACHE_SERVICE, PUT)} <= saved
    assert {(scheduler, "kvstash.prefix_lookup"), (scheduler, "kvstash.prefix_load"),
            (worker, RESTORE), (telemetry.CACHE_SERVICE, GET)} <= loaded
    assert (scheduler, "kvstash.prefix_save") not in loaded
