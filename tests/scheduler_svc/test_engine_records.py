"""The edge's records of in-flight requests match the core's live requests
however a request ends: finished, aborted, stopped by a stop string, failed
with its worker, or (P/D) finished, aborted or lost on a decode instance.

A fake worker link runs the steps (test_engine_reports.py); a prefill
instance hands off to scripted, in-memory decode instances."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from kvstash import errors
from kvstash.common import rpc_server, telemetry
from kvstash.common.layout import Layout
from kvstash.common.sampling import SamplingParams
from kvstash.common.tokenizer import ByteTokenizer
from kvstash.errors import IntegrityError
from kvstash.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc import handoff, tracing
from scheduler_svc.backend import Backend, BackendSlot
from scheduler_svc.core.config import Role
from scheduler_svc.core.outputs import OffloadCommand, SchedulerOutput
from scheduler_svc.core.request import RequestStatus, RequestUsage
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.decode_peers import (
    DecodePeer,
    DecodePeers,
    RemoteAborted,
    RemoteEvent,
    RemoteFinished,
    RemoteTokens,
)
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.inflight import InFlightRequests
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.server import SERVICE_NAME, SchedulerServicer
from scheduler_svc.streams import RequestStream
from scheduler_svc.worker_link import CopyOutcome
from tests.scheduler_svc.factories import make_scheduler
from tests.scheduler_svc.test_engine_reports import FakeStream, FakeWorkerLink, sample

PROMPT = [1, 2, 3, 4]
# What the in-process decode instance's worker has (the factories' blocks).
DECODE_LAYOUT = Layout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
HANG = "hang"  # in a script: the decode instance sends nothing more until cancelled


def sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def request_of(handoff_id: str) -> str:
    """The request a decode instance is asked about: it knows it by its
    hand-off's snapshot id ("<prefix>.<request id>.<serial>")."""
    _, request_id, serial = handoff_id.split(".")
    assert serial.isdigit(), handoff_id
    return request_id


@dataclass
class FakePeers:
    """Decode instances that reserve while `reservations` lasts and decode
    as `scripts` says, one script per Decode call."""

    scripts: list[list[RemoteEvent | Exception | str]]
    reservations: int = 1
    # Reservations are answered once it is set.
    answer: asyncio.Event = field(default_factory=asyncio.Event)
    asked: list[str] = field(default_factory=list)
    reserved: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.answer.set()

    async def reserve(self, handoff_id: str, prompt: Sequence[int],
                      sampling: SamplingParams) -> DecodePeer | None:
        request_id = request_of(handoff_id)
        self.asked.append(request_id)
        await self.answer.wait()
        if len(self.reserved) == self.reservations:
            return None
        self.reserved.append(request_id)
        return DecodePeer(f"decode-{len(self.reserved)}", None)  # type: ignore[arg-type]

    async def release(self, peer: DecodePeer, handoff_id: str) -> None:
        self.released.append(request_of(handoff_id))

    def release_later(self, peer: DecodePeer, handoff_id: str) -> asyncio.Task[None]:
        return asyncio.ensure_future(self.release(peer, handoff_id))

    async def decode(self, peer: DecodePeer, handoff_id: str, snapshot_id: str,
                     num_tokens: int, first_token_id: int) -> AsyncGenerator[RemoteEvent, None]:
        assert handoff_id == snapshot_id
        request_id = request_of(handoff_id)
        try:
            for item in self.scripts.pop(0):
                if isinstance(item, Exception):
                    raise item
                if item == HANG:
                    await asyncio.Event().wait()
                assert not isinstance(item, str)
                yield item
        finally:
            self.closed.append(request_id)


class FailingStream(FakeStream):
    """An Execute stream that breaks at its `fail_at`th step."""

    def __init__(self, fail_at: int) -> None:
        self.num_steps = 0
        self.fail_at = fail_at

    async def step(self, output: SchedulerOutput) -> dict[str, int]:
        self.num_steps += 1
        if self.num_steps == self.fail_at:
            raise errors.Unavailable("UNAVAILABLE: the worker went away")
        return await super().step(output)


@pytest.fixture
async def mixed() -> AsyncIterator[Engine]:
    engine = Engine(make_scheduler(), FakeWorkerLink(), None)  # type: ignore[arg-type]
    await engine.start()
    yield engine
    await engine.close()


def prefill_engine(peers: FakePeers, core: Scheduler | None = None,
                   metrics: SchedulerMetrics | None = None,
                   link: FakeWorkerLink | None = None) -> Engine:
    return Engine(core or make_scheduler(role=Role.PREFILL),  # type: ignore[arg-type]
                  link or FakeWorkerLink(), None, decode_peers=peers,  # type: ignore[arg-type]
                  metrics=metrics)


async def events_of(stream: RequestStream) -> tuple[list[int], RequestStatus | Exception]:
    tokens: list[int] = []
    while True:
        event = await asyncio.wait_for(stream.events.get(), 10)
        if isinstance(event, Exception):
            return tokens, event
        tokens.extend(event.new_token_ids)
        if event.finish_status is not None:
            return tokens, event.finish_status


async def until(condition: object, timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.001)


async def test_finished_aborted_and_stopped_requests_leave_no_record(mixed: Engine) -> None:
    streams = {rid: await mixed.admit(rid, PROMPT, sampling(6)) for rid in "abc"}
    mixed.check_integrity()
    await until(lambda: all(s.begun.is_set() for s in streams.values()))
    mixed.abort("b")
    mixed.abort("c", RequestStatus.FINISHED_STOPPED)  # a stop string, seen at the edge
    mixed.check_integrity()
    results = {rid: await events_of(s) for rid, s in streams.items()}
    assert results["a"] == ([7] * 6, RequestStatus.FINISHED_LENGTH)
    assert results["b"][1] is RequestStatus.FINISHED_ABORTED
    assert results["c"][1] is RequestStatus.FINISHED_STOPPED
    await until(lambda: mixed.core.is_idle)
    mixed.check_integrity()
    assert all(s.finished for s in streams.values())


async def test_requests_failed_with_their_worker_leave_no_record() -> None:
    class Link(FakeWorkerLink):
        async def open(self) -> FakeStream:
            return FailingStream(fail_at=3)

    engine = Engine(make_scheduler(), Link(), None)  # type: ignore[arg-type]
    await engine.start()
    try:
        streams = [await engine.admit(rid, PROMPT, sampling(50)) for rid in "ab"]
        for stream in streams:
            _, end = await events_of(stream)
            assert isinstance(end, errors.Unavailable) and "went away" in str(end)
        engine.check_integrity()
    finally:
        await engine.close()


def test_a_record_without_a_request_or_a_request_without_one_is_caught() -> None:
    core = make_scheduler()
    records = InFlightRequests(tracing_on=False)
    records.check(core)
    records.open("ghost")
    with pytest.raises(IntegrityError, match="ghost"):
        records.check(core)
    records.close("ghost")
    core.add_request("unseen", PROMPT, sampling(4))
    with pytest.raises(IntegrityError, match="holds 1 requests"):
        records.check(core)


async def test_a_mixed_instance_never_enters_pd_code(
        mixed: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("P/D code entered")

    for side in (handoff.PrefillSide, handoff.DecodeSide):
        for name in [n for n in vars(side) if not n.startswith("__")]:
            monkeypatch.setattr(side, name, never)
    stream = await mixed.admit("a", PROMPT, sampling(4))
    assert await events_of(stream) == ([7] * 4, RequestStatus.FINISHED_LENGTH)
    with pytest.raises(errors.FailedPrecondition):
        mixed.decode_side.reserve("b", PROMPT, sampling(4))


async def test_a_request_finished_on_its_decode_instance_leaves_no_record() -> None:
    usage = RequestUsage(4, 5, 0, 0, 0, None)
    peers = FakePeers([[RemoteTokens([8, 9]),
                        RemoteFinished([9, 8], RequestStatus.FINISHED_LENGTH, usage)]])
    engine = prefill_engine(peers)
    await engine.start()
    try:
        stream = await engine.admit("a", PROMPT, sampling(5))
        engine.check_integrity()
        assert await events_of(stream) == ([7, 8, 9, 9, 8], RequestStatus.FINISHED_LENGTH)
        engine.check_integrity()
        assert (peers.reserved, peers.released, peers.closed) == (["a"], [], ["a"])
    finally:
        await engine.close()


async def test_an_abort_while_relaying_cancels_the_relay_and_leaves_no_record() -> None:
    peers = FakePeers([[RemoteTokens([8]), HANG]])
    engine = prefill_engine(peers)
    await engine.start()
    try:
        stream = await engine.admit("a", PROMPT, sampling(5))
        await until(lambda: stream.events.qsize() >= 2)  # its first token, then one relayed
        engine.abort("a")
        assert await events_of(stream) == ([7, 8], RequestStatus.FINISHED_ABORTED)
        await until(lambda: peers.closed == ["a"])  # the Decode call is closed: aborted there
        engine.check_integrity()
        assert peers.released == []
    finally:
        await engine.close()


class GatedLink(FakeWorkerLink):
    """Copies out that each wait for their own gate, in call order."""

    def __init__(self) -> None:
        self.gates: list[asyncio.Event] = []

    async def offload(self, cmd: OffloadCommand, timeout_s: float) -> CopyOutcome:
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        return CopyOutcome(100 * len(cmd.block_ids))


async def test_an_id_reused_while_the_old_handoff_copy_is_in_flight_still_decodes() -> None:
    """"a" is aborted during its hand-off copy and admitted again: the old
    copy landing leaves the new request's hand-off alone."""
    usage = RequestUsage(4, 3, 0, 0, 0, None)
    peers = FakePeers([[RemoteFinished([8, 9], RequestStatus.FINISHED_LENGTH, usage)]])
    link = GatedLink()
    engine = prefill_engine(peers, link=link)
    await engine.start()
    try:
        old = await engine.admit("a", PROMPT, sampling(3))
        await until(lambda: len(link.gates) == 1)
        engine.abort("a")
        assert (await events_of(old))[1] is RequestStatus.FINISHED_ABORTED
        new = await engine.admit("a", PROMPT, sampling(3))
        await until(lambda: len(link.gates) == 2)
        link.gates[0].set()
        await until(lambda: len(engine.core.life.copies) == 1)  # the old copy landed
        link.gates[1].set()
        assert await asyncio.wait_for(events_of(new), 3) == (
            [7, 8, 9], RequestStatus.FINISHED_LENGTH)
        await until(lambda: engine.core.is_idle)
        engine.check_integrity()
    finally:
        await engine.close()


@pytest.mark.parametrize("lost", [
    errors.Unavailable("decode instance: gone"), RemoteAborted()], ids=["gone", "aborted"])
async def test_a_decode_instance_lost_before_its_first_token_finishes_here(
        lost: RemoteEvent | Exception) -> None:
    """No other instance reserves: the request is taken back and decodes here."""
    peers = FakePeers([[lost]])
    engine = prefill_engine(peers)
    await engine.start()
    try:
        stream = await engine.admit("a", PROMPT, sampling(5))
        assert await events_of(stream) == ([7] * 5, RequestStatus.FINISHED_LENGTH)
        engine.check_integrity()
        assert peers.closed == ["a"]
    finally:
        await engine.close()


@pytest.mark.parametrize("lost", [
    errors.NotFound("reservation expired"), RemoteAborted()], ids=["expired", "aborted"])
async def test_a_decode_instance_lost_before_its_first_token_is_replaced_by_another(
        lost: RemoteEvent | Exception) -> None:
    """Its reservation expired, it went away or it aborted the request (its
    worker lost): the snapshot is still in the cache, so another decode
    instance reserves and decodes it."""
    usage = RequestUsage(4, 4, 0, 0, 0, None)
    peers = FakePeers([[lost],
                       [RemoteFinished([8, 9, 8], RequestStatus.FINISHED_LENGTH, usage)]],
                      reservations=2)
    engine = prefill_engine(peers)
    await engine.start()
    try:
        stream = await engine.admit("a", PROMPT, sampling(4))
        assert await events_of(stream) == ([7, 8, 9, 8], RequestStatus.FINISHED_LENGTH)
        assert (peers.reserved, peers.closed) == (["a", "a"], ["a", "a"])
        await until(lambda: engine.core.is_idle)
        engine.check_integrity()
    finally:
        await engine.close()


async def test_a_decode_instance_that_failed_before_decoding_is_released() -> None:
    """Its Decode failed before any token: what it may still hold for the
    request is let go before another instance is asked."""
    usage = RequestUsage(4, 4, 0, 0, 0, None)
    peers = FakePeers([[errors.Unavailable("decode instance: connection reset")],
                       [RemoteFinished([8, 9, 8], RequestStatus.FINISHED_LENGTH, usage)]],
                      reservations=2)
    engine = prefill_engine(peers)
    await engine.start()
    try:
        stream = await engine.admit("a", PROMPT, sampling(4))
        assert await events_of(stream) == ([7, 8, 9, 8], RequestStatus.FINISHED_LENGTH)
        assert (peers.reserved, peers.released) == (["a", "a"], ["a"])
    finally:
        await engine.close()


@dataclass
class SlowToRelease(FakePeers):
    """Each release waits for `let_go`, once `releasing` says it began."""

    releasing: asyncio.Event = field(default_factory=asyncio.Event)
    let_go: asyncio.Event = field(default_factory=asyncio.Event)

    async def release(self, peer: DecodePeer, handoff_id: str) -> None:
        self.releasing.set()
        await self.let_go.wait()
        await super().release(peer, handoff_id)


async def test_an_abort_while_a_lost_instance_is_released_still_releases_it() -> None:
    """The abort cancelled the release (an Abort call there) the hand-off
    was waiting for: the instance held the reservation until it expired."""
    peers = SlowToRelease([[errors.Unavailable("decode instance: connection reset")]])
    engine = prefill_engine(peers)
    await engine.start()
    try:
        stream = await engine.admit("a", PROMPT, sampling(4))
        await asyncio.wait_for(peers.releasing.wait(), 10)
        engine.abort("a")
        assert (await events_of(stream))[1] is RequestStatus.FINISHED_ABORTED
        peers.let_go.set()
        await until(lambda: peers.released == ["a"])
        engine.check_integrity()
    finally:
        await engine.close()


async def test_a_decode_instance_lost_after_some_tokens_is_recomputed_here() -> None:
    peers = FakePeers([[RemoteTokens([8]), errors.Unavailable("decode instance: gone")]])
    engine = prefill_engine(peers)
    await engine.start()
    try:
        stream = await engine.admit("a", PROMPT, sampling(5))
        assert await events_of(stream) == ([7, 8, 7, 7, 7], RequestStatus.FINISHED_LENGTH)
        engine.check_integrity()
    finally:
        await engine.close()


@pytest.mark.parametrize(("script", "num_timed"), [
    ([RemoteTokens([8]), RemoteFinished([9], RequestStatus.FINISHED_LENGTH,
                                        RequestUsage(4, 3, 0, 0, 0, None))], 1),
    ([RemoteAborted()], 0),
], ids=["decoded", "aborted-there"])
async def test_a_hand_off_is_timed_only_to_a_token_from_its_decode_instance(
        script: list[RemoteEvent | Exception | str], num_timed: int) -> None:
    """handoff_seconds runs to the decode instance's first token: one
    aborted there before any token sent none (no other instance reserves:
    the request finishes here)."""
    core = make_scheduler(role=Role.PREFILL)
    metrics = SchedulerMetrics(core, asyncio.get_running_loop())
    engine = prefill_engine(FakePeers([script]), core, metrics)
    await engine.start()
    try:
        stream = await engine.admit("a", PROMPT, sampling(3))
        _, end = await events_of(stream)
        assert end is RequestStatus.FINISHED_LENGTH
        assert await sample(metrics, "handoff_seconds_count") == num_timed
    finally:
        await engine.close()


@contextlib.asynccontextmanager
async def seeking() -> AsyncIterator[tuple[FakePeers, Engine, RequestStream]]:
    """A prefill engine whose request "a" is prefilled, its first token sent
    and its KV copied out, asking a decode instance that does not answer yet."""
    peers = FakePeers([[RemoteFinished([8], RequestStatus.FINISHED_LENGTH,
                                       RequestUsage(4, 2, 0, 0, 0, None))]])
    peers.answer.clear()
    engine = prefill_engine(peers)
    await engine.start()
    try:
        stream = await engine.admit("a", PROMPT, sampling(2))
        await until(lambda: peers.asked == ["a"])
        yield peers, engine, stream
    finally:
        await engine.close()


async def test_a_request_is_prefilled_before_any_decode_instance_is_asked() -> None:
    """Decode blocks are reserved for KV about to arrive: the first token
    comes while no decode instance is asked, and decode follows there."""
    async with seeking() as (peers, engine, stream):
        first = await asyncio.wait_for(stream.events.get(), 10)
        assert not isinstance(first, Exception) and first.new_token_ids == [7]
        request = engine.core.get_request("a")
        assert request is not None and request.status is RequestStatus.HANDED_OFF
        peers.answer.set()
        assert await events_of(stream) == ([8], RequestStatus.FINISHED_LENGTH)
        assert (peers.reserved, peers.closed) == (["a"], ["a"])
        await until(lambda: engine.core.is_idle)
        engine.check_integrity()


async def test_an_abort_while_a_decode_instance_is_asked_stops_asking() -> None:
    async with seeking() as (peers, engine, stream):
        engine.abort("a")
        assert await events_of(stream) == ([7], RequestStatus.FINISHED_ABORTED)
        peers.answer.set()
        await until(lambda: engine.core.is_idle)
        assert peers.reserved == [] and engine.core.get_request("a") is None
        engine.check_integrity()
        with pytest.raises(errors.NotFound):  # it is gone: a second Abort finds nothing
            engine.abort("a")


async def test_an_engine_failed_while_a_decode_instance_is_asked_fails_the_request(
        ) -> None:
    async with seeking() as (peers, engine, stream):

        async def bug() -> None:
            raise KeyError("a bug")

        engine._tasks.spawn(bug())
        await asyncio.wait_for(engine.wait_failed(), 10)
        tokens, end = await events_of(stream)
        assert tokens == [7] and isinstance(end, errors.Unavailable)
        peers.answer.set()
        await asyncio.sleep(0.05)
        assert peers.reserved == []  # the asking stopped with the request


async def test_a_refused_admission_asks_no_decode_instance() -> None:
    peers = FakePeers([], reservations=2)
    engine = prefill_engine(peers, make_scheduler(max_num_waiting=1, role=Role.PREFILL))
    await engine.admit("a", PROMPT, sampling(5))  # never started: it stays waiting
    with pytest.raises(errors.ResourceExhausted):
        await engine.admit("b", PROMPT, sampling(5))
    engine.check_integrity()
    engine.abort("a")
    engine.check_integrity()
    assert peers.asked == [] and peers.released == []
    await engine.close()


class UnansweredCache:
    """A cache link whose prefix-tier lookups wait for `answer`."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.asked = 0

    async def stored_run(self, segment_ids: Sequence[str]) -> list[int]:
        self.asked += 1
        await self.answer.wait()
        return []

    async def watch(self, report: object) -> None:
        await asyncio.Event().wait()


async def test_an_abort_while_the_prefix_tier_is_asked_ends_the_request_unrun() -> None:
    """The Abort succeeds, the request never reaches the core, and its id is
    free again; a second admit of the id meanwhile is AlreadyExists."""
    cache = UnansweredCache()
    core = make_scheduler(prefix_segment_blocks=1, prefix_tier_salt="tiny")
    engine = Engine(core, FakeWorkerLink(), cache)  # type: ignore[arg-type]
    await engine.start()
    try:
        admitted = asyncio.create_task(engine.admit("a", PROMPT * 8, sampling(5)))
        await until(lambda: cache.asked == 1)
        with pytest.raises(errors.AlreadyExists):
            await engine.admit("a", PROMPT, sampling(5))
        engine.abort("a")
        cache.answer.set()
        stream = await admitted
        assert await events_of(stream) == ([], RequestStatus.FINISHED_ABORTED)
        assert stream.usage is not None and stream.usage.num_prompt_tokens == 32
        assert core.get_request("a") is None
        engine.check_integrity()
        with pytest.raises(errors.NotFound):  # it is gone: a second Abort finds nothing
            engine.abort("a")
    finally:
        await engine.close()


Spans = Callable[[], Sequence[ReadableSpan]]


@pytest.fixture
def finished_spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spans]:
    """The scheduler's tracing set up as in the service, into memory: the
    spans finished so far."""
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    exporter = InMemorySpanExporter()
    handle = telemetry.setup_tracing(telemetry.SCHEDULER_SERVICE, env={}, exporter=exporter)
    assert handle is not None
    # The module's proxy tracer holds the first provider it met: a fresh one.
    monkeypatch.setattr(tracing, "_tracer", trace.get_tracer("kvstash.scheduler"))

    def spans() -> Sequence[ReadableSpan]:
        handle.provider.force_flush()
        return exporter.get_finished_spans()

    yield spans
    handle.shutdown()


class FailingPuts(FakeWorkerLink):
    async def offload(self, cmd: OffloadCommand, timeout_s: float) -> CopyOutcome:
        return CopyOutcome(None, "the cache is down")


@pytest.mark.parametrize(("script", "link", "outcome"), [
    ([], FailingPuts(), None),
    ([[RemoteAborted()]], FakeWorkerLink(), "resume_from_snapshot"),
    ([[RemoteTokens([8]), errors.Unavailable("decode instance: gone")]], FakeWorkerLink(),
     "recompute"),
], ids=["put-failed", "taken-back-before-tokens", "taken-back-after-tokens"])
async def test_a_failed_hand_off_says_how_the_request_goes_on(
        finished_spans: Spans, script: list[list[RemoteEvent | Exception | str]],
        link: FakeWorkerLink, outcome: str | None) -> None:
    """Its put failed: the request decodes here from its blocks
    (decode_here on the kvstash.handoff span). Taken back from its decode
    instance: the Generate span's "taken_back" event says whether it
    resumes from its snapshot (nothing came back yet) or is recomputed."""
    engine = Engine(make_scheduler(role=Role.PREFILL), link, None,  # type: ignore[arg-type]
                    EngineConfig(tracing=True), decode_peers=FakePeers(script))  # type: ignore[arg-type]
    await engine.start()
    try:
        with trace.get_tracer(__name__).start_as_current_span("Generate"):  # the whole call
            stream = await engine.admit("a", PROMPT, sampling(5))
            _, end = await events_of(stream)
        assert end is RequestStatus.FINISHED_LENGTH
    finally:
        await engine.close()
    spans = {s.name: s for s in finished_spans()}
    put = spans["kvstash.handoff"]
    assert put.attributes is not None
    assert put.attributes["kvstash.outcome"] == ("decode_here" if outcome is None else "copied")
    taken_back = [e for e in spans["Generate"].events if e.name == "taken_back"]
    assert [e.attributes and e.attributes["kvstash.outcome"] for e in taken_back] == (
        [] if outcome is None else [outcome])


async def test_a_decode_instances_part_of_a_request_is_one_decode_phase(
        finished_spans: Spans) -> None:
    """Its prompt was prefilled on the prefill instance: its trace shows
    the restore and one kvstash.decode span here, no second kvstash.queued
    and kvstash.prefill (the first step here decodes)."""
    engine = Engine(make_scheduler(role=Role.DECODE), FakeWorkerLink(),  # type: ignore[arg-type]
                    None, EngineConfig(tracing=True))
    await engine.start()
    try:
        await asyncio.wait_for(engine.wait_until_worker_up(), 10)
        assert engine.decode_side.reserve("a", PROMPT, sampling(3))
        with trace.get_tracer(__name__).start_as_current_span("Decode"):
            stream = engine.decode_side.decode("a", "prefill-a-0", len(PROMPT), 9)
        assert await events_of(stream) == ([7, 7], RequestStatus.FINISHED_LENGTH)
    finally:
        await engine.close()
    names = sorted(s.name for s in finished_spans())
    assert names == ["Decode", "kvstash.decode", "kvstash.restore"]


class HeldDecode(grpc.aio.ServerInterceptor):
    """Holds each Decode call until `go` is set, once `arrived` says so."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.go = asyncio.Event()

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        if details.method.endswith("/Decode"):
            self.arrived.set()
            await self.go.wait()
        return await continuation(details)


@contextlib.asynccontextmanager
async def decode_instance(interceptor: HeldDecode) -> AsyncIterator[tuple[Engine, str]]:
    """A decode instance's engine behind a real gRPC server; its address."""
    engine = Engine(make_scheduler(role=Role.DECODE), FakeWorkerLink(),  # type: ignore[arg-type]
                    None)
    slot = BackendSlot()
    servicer = SchedulerServicer(slot)
    server, port, _ = await rpc_server.create_server(
        "127.0.0.1:0", [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, s)],
        [SERVICE_NAME], interceptors=[interceptor])
    await engine.start()
    try:
        await asyncio.wait_for(engine.wait_until_worker_up(), 10)
        slot.attach(Backend(engine, ByteTokenizer(),
                            SchedulerMetrics(engine.core, asyncio.get_running_loop()),
                            kv_layout=DECODE_LAYOUT))
        yield engine, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
        await engine.close()


async def test_an_abort_before_the_decode_instance_took_the_decode_releases_it() -> None:
    """Aborted once the decode instance had reserved but before it took the
    Decode call (its request not yet out, or not yet served there): the
    cancelled call told it nothing, and it held the reservation's blocks and
    seat until --reservation-timeout (30 s)."""
    held = HeldDecode()
    async with decode_instance(held) as (decoder, address):
        peers = DecodePeers([address], DECODE_LAYOUT, wait_s=10)
        engine = Engine(make_scheduler(role=Role.PREFILL), FakeWorkerLink(),  # type: ignore[arg-type]
                        None, decode_peers=peers)
        await engine.start()
        try:
            stream = await engine.admit("a", PROMPT, sampling(5))
            await asyncio.wait_for(held.arrived.wait(), 10)
            assert decoder.core.stats().num_reserved == 1
            engine.abort("a")
            assert (await events_of(stream))[1] is RequestStatus.FINISHED_ABORTED
            held.go.set()
            await until(lambda: decoder.core.stats().num_reserved == 0)
            decoder.check_integrity()
            engine.check_integrity()
        finally:
            await engine.close()
            await peers.close()


async def test_a_release_of_a_reservation_already_gone_changes_nothing() -> None:
    """What a prefill instance sends when unsure its Decode was served: where
    the reservation was used and aborted, or released already, it is
    NOT_FOUND there and nothing else."""
    async with decode_instance(HeldDecode()) as (decoder, address):
        peers = DecodePeers([address], DECODE_LAYOUT, wait_s=10)
        try:
            peer = await peers.reserve("h.a.1", PROMPT, sampling(5))
            assert peer is not None and decoder.core.stats().num_reserved == 1
            for _ in range(2):
                await peers.release(peer, "h.a.1")
                assert decoder.core.stats().num_reserved == 0
                decoder.check_integrity()
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await peer.stub.Abort(scheduler_pb2.AbortRequest(request_id="h.a.1"), timeout=10)
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
            assert await peers.reserve("h.b.2", PROMPT, sampling(5)) is not None
            assert decoder.core.stats().num_reserved == 1
        finally:
            await peers.close()
