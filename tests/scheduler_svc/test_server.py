"""The Scheduler's gRPC edge over a real channel, in process: client input it
refuses comes back as a short INVALID_ARGUMENT, whatever its size or bytes.

The engine is attached but never started (no worker is needed to refuse a
request); health stays NOT_SERVING until an engine reports its worker up."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from kvstash import rpc
from kvstash.tokenizer import ByteTokenizer
from kvstash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.backend import Backend
from scheduler_svc.core.outputs import SchedulerStats
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine import Engine
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.server import (
    SERVICE_NAME,
    SchedulerServer,
    create_scheduler_server,
    stats_to_proto,
)
from scheduler_svc.worker_link import WorkerLink
from tests.scheduler_svc.factories import make_scheduler

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HUGE_ID = "r" * 10_000
# Raw request bytes that do not decode: garbage, and invalid UTF-8 (0xff) in
# a string field (tag 0x0a = field 1, request_id; 0x12 = field 2, text).
GARBAGE = b"\xff\xff\xff\xff"
BAD_ID = b"\x0a\x02r\xff"
BAD_TEXT = b"\x12\x03ab\xff"


@pytest.fixture
async def server() -> AsyncIterator[SchedulerServer]:
    scheduler = await create_scheduler_server("127.0.0.1:0")
    yield scheduler
    await scheduler.server.stop(None)


@pytest.fixture
async def channel(server: SchedulerServer) -> AsyncIterator[grpc.aio.Channel]:
    async with rpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


@pytest.fixture
async def attached(server: SchedulerServer) -> AsyncIterator[SchedulerServer]:
    core = make_scheduler(vocab_size=258, max_num_waiting=2)
    async with grpc.aio.insecure_channel("127.0.0.1:1") as nowhere:
        engine = Engine(core, WorkerLink(nowhere), None)
        server.servicer.attach(Backend(engine, ByteTokenizer(),
                                       SchedulerMetrics(core, asyncio.get_running_loop())))
        yield server


def generate_request(request_id: str) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(
        request_id=request_id, token_ids=scheduler_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=common_pb2.SamplingParams(max_tokens=4))


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if isinstance(call, grpc.aio.UnaryStreamCall):
            async for _ in call:
                pass
        else:
            await call  # type: ignore[misc]
    return info.value


async def test_not_serving_and_unavailable_until_attached(
    server: SchedulerServer, channel: grpc.aio.Channel
) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == NOT_SERVING
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    for call in (stub.Generate(generate_request("r1")),
                 stub.GetStats(common_pb2.GetStatsRequest())):
        assert (await rpc_error(call)).code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("method", ["Generate", "Abort"])
@pytest.mark.parametrize("request_id", [HUGE_ID, "bad id", "x" * 129])
async def test_bad_request_id_is_a_short_invalid_argument(
    attached: SchedulerServer, channel: grpc.aio.Channel, method: str, request_id: str
) -> None:
    # Before: the 10,000-char id came back whole in the message, and grpc
    # answered RESOURCE_EXHAUSTED ("received metadata size exceeds soft limit").
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    call = (stub.Generate(generate_request(request_id)) if method == "Generate"
            else stub.Abort(scheduler_pb2.AbortRequest(request_id=request_id)))
    error = await rpc_error(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.details() or ""
    assert "request_id" in details and len(details) < 200


async def test_a_full_waiting_queue_is_resource_exhausted_and_nothing_is_lost(
    attached: SchedulerServer, channel: grpc.aio.Channel
) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    waiting = [stub.Generate(generate_request(f"w{i}")) for i in range(2)]
    core = attached.servicer.attached().engine.core
    async with asyncio.timeout(10):  # the engine never runs: both stay queued
        while core.stats().num_waiting < 2:
            await asyncio.sleep(0.01)
    error = await rpc_error(stub.Generate(generate_request("one-too-many")))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waiting queue is full (2 requests, max_num_waiting 2)" in (error.details() or "")
    assert core.stats().num_waiting == 2 and core.get_request("one-too-many") is None
    for call in waiting:
        call.cancel()
    async with asyncio.timeout(10):  # the clients left: their places are free again
        while core.stats().num_waiting:
            await asyncio.sleep(0.01)


async def test_abort_of_an_unknown_request_is_not_found(
    attached: SchedulerServer, channel: grpc.aio.Channel
) -> None:
    call = scheduler_pb2_grpc.SchedulerStub(channel).Abort(
        scheduler_pb2.AbortRequest(request_id="x" * 128))
    assert (await rpc_error(call)).code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("method", "raw"), [
    ("Generate", GARBAGE), ("Generate", BAD_ID), ("Generate", BAD_TEXT),
    ("Abort", GARBAGE), ("Abort", BAD_ID), ("GetStats", GARBAGE),
])
async def test_undecodable_request_is_invalid_argument(
    attached: SchedulerServer, channel: grpc.aio.Channel, method: str, raw: bytes
) -> None:
    # Before: UNKNOWN, "Unexpected <class 'google.protobuf.message.DecodeError'>".
    path = f"/{SERVICE_NAME}/{method}"
    call = (channel.unary_stream(path)(raw) if method == "Generate"
            else channel.unary_unary(path)(raw))
    error = await rpc_error(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "<class" not in (error.details() or "")


async def test_raw_stats_request_decodes(
    attached: SchedulerServer, channel: grpc.aio.Channel
) -> None:
    raw = await channel.unary_unary(f"/{SERVICE_NAME}/GetStats")(b"")
    stats = scheduler_pb2.SchedulerStats.FromString(raw)
    assert stats.num_total_blocks == 64 and not stats.cache_available


def test_stats_proto_and_core_stats_have_the_same_fields() -> None:
    """GetStats converts field by field by name: neither side may have one the
    other lacks (a proto field the core never fills would read 0 forever)."""
    core_fields = {f.name for f in dataclasses.fields(SchedulerStats)}
    proto_fields = {f.name for f in scheduler_pb2.SchedulerStats.DESCRIPTOR.fields}
    assert core_fields == proto_fields
    stats = make_scheduler().stats()
    assert stats_to_proto(stats).num_total_blocks == stats.num_total_blocks == 64


async def generate_n(engine: vllm_engine_pb2_grpc.VllmEngineStub, core: Scheduler,
                     request_id: str, n: int) -> grpc.aio.UnaryStreamCall:
    """A VllmEngine Generate of n sequences, once its first is queued."""
    call = engine.Generate(vllm_engine_pb2.GenerateRequest(
        request_id=request_id, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=4, n=n), stream=True))
    async with asyncio.timeout(10):
        while core.get_request(f"{request_id}:0") is None:
            await asyncio.sleep(0.01)
    return call


async def test_an_abort_while_n_sequences_are_submitted_ends_every_one(
    attached: SchedulerServer, channel: grpc.aio.Channel
) -> None:
    """The first of n sequences goes alone until its first token (never, here:
    the engine does not run); an Abort then ends it and the others, which
    are never submitted."""
    engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    core = attached.servicer.attached().engine.core
    call = await generate_n(engine, core, "n2", 2)
    await engine.Abort(vllm_engine_pb2.AbortRequest(request_ids=["n2"]))
    completes = [r.complete async for r in call]
    assert sorted((c.index, c.finish_reason) for c in completes) == [(0, "abort"), (1, "abort")]
    assert core.get_request("n2:0") is None and core.get_request("n2:1") is None
    assert core.stats().num_waiting == 0


async def test_a_call_cancelled_while_n_sequences_are_submitted_leaves_none(
    attached: SchedulerServer, channel: grpc.aio.Channel
) -> None:
    core = attached.servicer.attached().engine.core
    call = await generate_n(vllm_engine_pb2_grpc.VllmEngineStub(channel), core, "gone", 3)
    call.cancel()
    async with asyncio.timeout(10):  # the first is taken back; the others never came
        while core.stats().num_waiting:
            await asyncio.sleep(0.01)
    assert all(core.get_request(f"gone:{i}") is None for i in range(3))
