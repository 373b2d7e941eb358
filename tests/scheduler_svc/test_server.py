"""The Scheduler's gRPC edge over a real channel, in process: client input it
refuses comes back as a short INVALID_ARGUMENT, whatever its size or bytes.

The engine is attached but never started (no worker is needed to refuse a
request); health stays NOT_SERVING until an engine reports its worker up."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as vllm_common_pb2

from kvstash.common import rpc_connections
from kvstash.common.layout import Layout
from kvstash.common.tokenizer import INLINE_ENCODE_CHARS, ByteTokenizer, load_tokenizer
from kvstash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.backend import Backend
from scheduler_svc.core.config import Role
from scheduler_svc.core.outputs import SchedulerStats
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.decode_peers import DecodePeers
from scheduler_svc.engine import Engine
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.server import SERVICE_NAME, stats_to_proto
from scheduler_svc.serving import SchedulerServer, create_scheduler_server
from scheduler_svc.vllm_info import package_version
from scheduler_svc.worker_link import WorkerLink
from tests.kvstash.common.test_tokenizer_encode import llama_style_tokenizer_json
from tests.scheduler_svc.factories import make_scheduler

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HUGE_ID = "r" * 10_000
# Raw request bytes that do not decode: garbage, and invalid UTF-8 (0xff) in
# a string field (tag 0x0a = field 1, request_id; 0x12 = field 2, text).
GARBAGE = b"\xff\xff\xff\xff"
BAD_ID = b"\x0a\x02r\xff"
BAD_TEXT = b"\x12\x03ab\xff"
# A prefill instance's decode instances' layout (never dialled here).
LAYOUT = Layout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


@pytest.fixture
async def server() -> AsyncIterator[SchedulerServer]:
    scheduler = await create_scheduler_server("127.0.0.1:0")
    yield scheduler
    await scheduler.server.stop(None)


@pytest.fixture
async def channel(server: SchedulerServer) -> AsyncIterator[grpc.aio.Channel]:
    async with rpc_connections.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


@pytest.fixture
async def nowhere() -> AsyncIterator[grpc.aio.Channel]:
    """A worker channel that never connects: the engine is never started."""
    async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
        yield channel


def attach(server: SchedulerServer, nowhere: grpc.aio.Channel, core: Scheduler,
           **fields: Any) -> SchedulerServer:
    """`server` serving `core` (through an engine that never runs, in the
    core's role), the Backend's other fields as `fields` say."""
    peers = DecodePeers(["127.0.0.1:1"], LAYOUT) if core.config.role is Role.PREFILL else None
    engine = Engine(core, WorkerLink(nowhere), None, decode_peers=peers)
    backend = Backend(engine, fields.pop("tokenizer", ByteTokenizer()),
                      SchedulerMetrics(core, asyncio.get_running_loop()), **fields)
    server.attach(backend)
    return server


@pytest.fixture
async def attached(server: SchedulerServer, nowhere: grpc.aio.Channel) -> SchedulerServer:
    return attach(server, nowhere, make_scheduler(vocab_size=258, max_num_waiting=2))


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
@pytest.mark.parametrize("request_id", [HUGE_ID, "bad id", "x" * 257, "tab\there", "nul\x00",
                                        "del\x7f", "caf\u00e9"])
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
    core = attached.attached().engine.core
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


# Any visible ASCII, up to 256 characters: the ids gateways make (smg's
# "<x-request-id>-<uuid7>", a client's own rid) pass as they are.
GATEWAY_IDS = ["x" * 256, "cmpl/7Q+z9w==", "!~\"#$%&'()*,;<>?@[\\]^`{|}"]


@pytest.mark.parametrize("request_id", GATEWAY_IDS)
async def test_abort_of_an_unknown_request_is_not_found(
    attached: SchedulerServer, channel: grpc.aio.Channel, request_id: str
) -> None:
    call = scheduler_pb2_grpc.SchedulerStub(channel).Abort(
        scheduler_pb2.AbortRequest(request_id=request_id))
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


async def finished_by_reason(server: SchedulerServer, reason: str) -> float:
    """The scheduler's finished_requests_by_reason counter (read off the loop:
    its collector reads the core through it)."""
    registry = server.attached().metrics.registry
    value = await asyncio.to_thread(
        registry.get_sample_value, "kvstash_scheduler_finished_requests_by_reason_total",
        {"reason": reason})
    return value or 0.0


async def test_an_abort_while_n_sequences_are_submitted_ends_every_one(
    attached: SchedulerServer, channel: grpc.aio.Channel
) -> None:
    """The first of n sequences goes alone until its first token (never, here:
    the engine does not run); an Abort then ends it and the others, which
    are never submitted, so the metrics count the first only."""
    engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    core = attached.attached().engine.core
    call = await generate_n(engine, core, "n3", 3)
    await engine.Abort(vllm_engine_pb2.AbortRequest(request_ids=["n3"]))
    completes = [r.complete async for r in call]
    assert sorted((c.index, c.finish_reason) for c in completes) == [
        (0, "abort"), (1, "abort"), (2, "abort")]
    assert all(core.get_request(f"n3:{i}") is None for i in range(3))
    assert core.stats().num_waiting == 0
    assert await finished_by_reason(attached, "abort") == 1


async def test_a_call_cancelled_while_n_sequences_are_submitted_leaves_none(
    attached: SchedulerServer, channel: grpc.aio.Channel
) -> None:
    core = attached.attached().engine.core
    call = await generate_n(vllm_engine_pb2_grpc.VllmEngineStub(channel), core, "gone", 3)
    call.cancel()
    async with asyncio.timeout(10):  # the first is taken back; the others never came
        while core.stats().num_waiting:
            await asyncio.sleep(0.01)
    assert all(core.get_request(f"gone:{i}") is None for i in range(3))


def vllm_generate(request_id: str, prompt: list[int], stream: bool = True,
                  **sampling: Any) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id=request_id, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=vllm_engine_pb2.SamplingParams(**sampling), stream=stream)


async def queued(core: Scheduler, request_id: str) -> None:
    async with asyncio.timeout(10):
        while core.get_request(request_id) is None:
            await asyncio.sleep(0.01)


class HeldTokenizer(ByteTokenizer):
    """A byte tokenizer whose encode waits until the test lets it go: a long
    prompt's tokenization (on a thread), as long as the test needs."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        self.started.set()
        self.release.wait(10)
        return super().encode(text)


async def abort_while_tokenized(stub: scheduler_pb2_grpc.SchedulerStub, tokenizer: HeldTokenizer,
                                request_id: str) -> Any:
    """A Generate of a long text prompt on the kvstash API, aborted while
    `tokenizer` holds its tokenization; the call, for its responses."""
    call = stub.Generate(scheduler_pb2.GenerateRequest(
        request_id=request_id, text="a" * (INLINE_ENCODE_CHARS + 1),
        sampling=common_pb2.SamplingParams(max_tokens=4)))
    try:
        assert await asyncio.to_thread(tokenizer.started.wait, 10)
        await stub.Abort(scheduler_pb2.AbortRequest(request_id=request_id))
    finally:
        tokenizer.release.set()
    return call


async def test_an_abort_while_a_long_prompt_is_tokenized_ends_the_call(
    server: SchedulerServer, nowhere: grpc.aio.Channel, channel: grpc.aio.Channel
) -> None:
    """Before the call was known until its prompt was tokenized: a gateway's
    Abort then found nothing, and the request ran to its end."""
    tokenizer = HeldTokenizer()
    core = make_scheduler(vocab_size=258, max_model_len=20_000, num_blocks=5_000)
    attach(server, nowhere, core, tokenizer=tokenizer)
    engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    call = engine.Generate(vllm_engine_pb2.GenerateRequest(
        request_id="long", text="a" * (INLINE_ENCODE_CHARS + 1), stream=True,
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=4)))
    assert await asyncio.to_thread(tokenizer.started.wait, 10)
    await engine.Abort(vllm_engine_pb2.AbortRequest(request_ids=["long"]))
    tokenizer.release.set()
    async with asyncio.timeout(10):  # before: it waited for a step that never came
        assert [r.complete.finish_reason async for r in call] == ["abort"]
    assert core.get_request("long") is None and core.stats().num_waiting == 0


async def test_the_kvstash_api_ends_a_call_aborted_while_its_long_prompt_is_tokenized(
    server: SchedulerServer, nowhere: grpc.aio.Channel, channel: grpc.aio.Channel
) -> None:
    """Its Abort answered NOT_FOUND (the core knew nothing of it yet), and
    the request ran to its end once tokenized."""
    tokenizer = HeldTokenizer()
    core = make_scheduler(vocab_size=258, max_model_len=20_000, num_blocks=5_000)
    attach(server, nowhere, core, tokenizer=tokenizer)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    call = stub.Generate(scheduler_pb2.GenerateRequest(
        request_id="long", text="a" * (INLINE_ENCODE_CHARS + 1),
        sampling=common_pb2.SamplingParams(max_tokens=4)))
    try:
        assert await asyncio.to_thread(tokenizer.started.wait, 10)
        again = stub.Generate(generate_request("long"))  # one call per id, tokenizing or not
        async with asyncio.timeout(10):  # before: admitted, to run for ever here
            assert (await rpc_error(again)).code() == grpc.StatusCode.ALREADY_EXISTS
        await stub.Abort(scheduler_pb2.AbortRequest(request_id="long"))
    finally:
        tokenizer.release.set()
    async with asyncio.timeout(10):
        responses = [r async for r in call]
    assert responses[-1].finish_reason == scheduler_pb2.FINISH_REASON_ABORT
    assert core.get_request("long") is None and core.stats().num_waiting == 0


async def test_an_abort_also_reaches_the_live_request_whose_id_a_second_call_tokenizes(
    server: SchedulerServer, nowhere: grpc.aio.Channel, channel: grpc.aio.Channel
) -> None:
    """A second Generate under a live request's id (a gateway's retry), its
    long prompt tokenized: an Abort marked only that call, and the live
    request ran on."""
    tokenizer = HeldTokenizer()
    core = make_scheduler(vocab_size=258, max_model_len=20_000, num_blocks=5_000)
    attach(server, nowhere, core, tokenizer=tokenizer)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    live = stub.Generate(generate_request("dup"))
    async with asyncio.timeout(10):
        while core.get_request("dup") is None:
            await asyncio.sleep(0.01)
    again = await abort_while_tokenized(stub, tokenizer, "dup")
    async with asyncio.timeout(10):
        assert [r async for r in live][-1].finish_reason == scheduler_pb2.FINISH_REASON_ABORT
        assert [r async for r in again][-1].finish_reason == scheduler_pb2.FINISH_REASON_ABORT
    assert core.get_request("dup") is None


async def test_an_abort_naming_a_bad_id_aborts_none(
    attached: SchedulerServer, channel: grpc.aio.Channel
) -> None:
    """Every id is checked before any is aborted: one bad id leaves no batch
    half done. Ids as gateways make them are accepted."""
    engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    core = attached.attached().engine.core
    call = engine.Generate(vllm_generate("keep-1", [1, 2, 3], max_tokens=4))
    await queued(core, "keep-1")
    error = await rpc_error(engine.Abort(vllm_engine_pb2.AbortRequest(
        request_ids=["keep-1", "bad id"])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "'bad id'" in (
        error.details() or "")
    assert core.get_request("keep-1") is not None
    await engine.Abort(vllm_engine_pb2.AbortRequest(request_ids=["keep-1", *GATEWAY_IDS]))
    assert [r.complete.finish_reason async for r in call] == ["abort"]


async def test_info_names_the_model_and_no_vllm_kv_role(
    server: SchedulerServer, nowhere: grpc.aio.Channel, channel: grpc.aio.Channel
) -> None:
    """A P/D prefill instance hands KV off itself: to a gateway it is no vLLM
    KV producer (which it would pair with vLLM decode workers)."""
    attach(server, nowhere, make_scheduler(vocab_size=258, role=Role.PREFILL),
           model_type="qwen2", architectures=("Qwen2ForCausalLM",))
    engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    info = await engine.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
    assert (info.model_type, list(info.architectures)) == ("qwen2", ["Qwen2ForCausalLM"])
    server_info = await engine.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
    assert (server_info.kv_role, server_info.kv_connector) == ("", "")
    loads = await engine.GetLoads(vllm_engine_pb2.GetLoadsRequest())
    assert loads.version == f"kvstash {importlib.metadata.version('kvstash')}"


async def test_an_unexpected_failure_is_internal_with_a_message(
    server: SchedulerServer, nowhere: grpc.aio.Channel, channel: grpc.aio.Channel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug (here: a backend without a tokenizer, and with a tokenizer file
    that is no text) is INTERNAL with what failed, logged with its traceback,
    never grpc's UNKNOWN."""
    attach(server, nowhere, make_scheduler(vocab_size=258), tokenizer=None,
           tokenizer_files={"tokenizer.json": None})
    engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    calls = {
        "Generate": engine.Generate(vllm_engine_pb2.GenerateRequest(
            request_id="text", text="hello", sampling_params=vllm_engine_pb2.SamplingParams(
                max_tokens=4))),
        "GetTokenizer": engine.GetTokenizer(vllm_common_pb2.GetTokenizerRequest()),
    }
    for name, call in calls.items():
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.INTERNAL, name
        assert name in (error.details() or "") and "Error" in (error.details() or ""), name
        assert any(name in r.getMessage() and r.exc_info for r in caplog.records), name


def test_a_source_tree_without_package_metadata_still_reports_a_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from a checkout on PYTHONPATH (a lent GPU machine), the scheduler
    starts; it used to exit on the missing metadata."""
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    assert package_version() == importlib.metadata.version("kvstash")
    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert package_version() == "(source tree)"


@pytest.mark.parametrize("api", ["kvstash", "vllm"])
async def test_a_text_prompt_is_encoded_with_the_bos_its_tokenizer_adds(
    server: SchedulerServer, nowhere: grpc.aio.Channel, channel: grpc.aio.Channel, api: str
) -> None:
    """As vLLM encodes a text prompt: a Llama tokenizer.json's post-processor
    puts BOS first. Before, the prompt went without it (other ids than
    through vLLM, other outputs, one prompt token fewer in usage)."""
    tokenizer = load_tokenizer(llama_style_tokenizer_json(), 6, (2,))
    core = make_scheduler(vocab_size=6)
    attach(server, nowhere, core, tokenizer=tokenizer)
    sampling = {"max_tokens": 4}
    call = (scheduler_pb2_grpc.SchedulerStub(channel).Generate(scheduler_pb2.GenerateRequest(
                request_id="text", text="kv cache world",
                sampling=common_pb2.SamplingParams(**sampling)))
            if api == "kvstash" else
            vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
                vllm_engine_pb2.GenerateRequest(
                    request_id="text", text="kv cache world",
                    sampling_params=vllm_engine_pb2.SamplingParams(**sampling))))
    await queued(core, "text")
    request = core.get_request("text")
    assert request is not None and request.prompt_token_ids == (1, 3, 4, 5)
    call.cancel()
