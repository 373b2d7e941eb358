"""A lost worker fails the requests it held; the others wait for it, for at
most EngineConfig.worker_reconnect_s, and then run on it, or fail saying it
did not come back (and new requests are refused until it does).

A fake worker link (no process) that can be lost and brought back; the same
with real processes is tests/integration/test_worker_restart.py."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import pytest

from kvstash import errors
from kvstash.common.sampling import SamplingParams
from scheduler_svc.__main__ import main as scheduler_main
from scheduler_svc.core.config import PreemptionMode
from scheduler_svc.core.outputs import OffloadCommand, SchedulerOutput
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.streams import RequestStream
from scheduler_svc.worker_link import CopyOutcome
from tests.scheduler_svc.factories import make_scheduler
from tests.scheduler_svc.test_engine_records import events_of
from tests.scheduler_svc.test_engine_reports import FakeStream, FakeWorkerLink, pressured_core

PROMPT = [1, 2, 3, 4]


class LosableStream(FakeStream):
    def __init__(self) -> None:
        self.lost = False

    async def step(self, output: SchedulerOutput) -> dict[str, int]:
        await asyncio.sleep(0.005)
        if self.lost:
            raise errors.Unavailable("UNAVAILABLE: the worker went away")
        return {seq.request_id: 7 for seq in output.seqs if seq.sample}


class LosableLink(FakeWorkerLink):
    """A worker that `lose()` takes away and `come_back()` returns."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.ready.set()
        self.stream = LosableStream()

    async def wait_ready(self, deadline: float | None = None) -> bool:
        try:
            async with asyncio.timeout_at(deadline):
                await self.ready.wait()
        except TimeoutError:
            return False
        return True

    async def open(self) -> LosableStream:
        self.stream = LosableStream()
        return self.stream

    def lose(self) -> None:
        self.ready.clear()
        self.stream.lost = True

    def come_back(self) -> None:
        self.ready.set()


async def started(link: LosableLink, config: EngineConfig) -> tuple[Engine, RequestStream,
                                                                      list[RequestStream]]:
    """One seat: "run" decodes on the worker, "w1" and "w2" wait behind it."""
    engine = Engine(make_scheduler(max_num_seqs=1), link, None, config)  # type: ignore[arg-type]
    await engine.start()
    running = await engine.admit("run", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
    await asyncio.wait_for(running.begun.wait(), 10)
    waiting = [await engine.admit(rid, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
               for rid in ("w1", "w2")]
    assert engine.core.stats().num_waiting == 2
    return engine, running, waiting


@pytest.fixture
def link() -> LosableLink:
    return LosableLink()


@pytest.fixture
async def closing() -> AsyncIterator[list[Engine]]:
    engines: list[Engine] = []
    yield engines
    for engine in engines:
        await engine.close()


async def test_waiting_requests_run_on_the_worker_once_it_is_back(
        link: LosableLink, closing: list[Engine]) -> None:
    engine, running, waiting = await started(link, EngineConfig(worker_reconnect_s=30))
    closing.append(engine)
    link.lose()
    _, end = await events_of(running)
    assert isinstance(end, errors.Unavailable) and "went away" in str(end)
    await asyncio.sleep(0.1)
    assert all(stream.events.empty() and not stream.finished for stream in waiting)
    assert not engine.worker_up
    link.come_back()
    for stream in waiting:
        assert await events_of(stream) == ([7, 7, 7], RequestStatus.FINISHED_LENGTH)
    engine.check_integrity()


async def test_waiting_requests_fail_once_the_worker_is_not_back_in_time(
        link: LosableLink, closing: list[Engine]) -> None:
    engine, running, waiting = await started(link, EngineConfig(worker_reconnect_s=0.3))
    closing.append(engine)
    link.lose()
    lost_at = asyncio.get_running_loop().time()
    assert isinstance((await events_of(running))[1], errors.Unavailable)
    for stream in waiting:
        _, end = await events_of(stream)
        assert isinstance(end, errors.Unavailable)
        assert "not back within 0.3 s (scheduler --worker-reconnect)" in str(end)
        assert "went away" in str(end)  # why it was lost
    assert asyncio.get_running_loop().time() - lost_at >= 0.3
    with pytest.raises(errors.Unavailable, match=r"gone for over 0\.3 s"):
        await engine.admit("late", PROMPT, SamplingParams(max_tokens=3))
    engine.check_integrity()
    link.come_back()
    async with asyncio.timeout(10):
        while not engine.worker_up:
            await asyncio.sleep(0.005)
    again = await engine.admit("again", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    assert await events_of(again) == ([7, 7, 7], RequestStatus.FINISHED_LENGTH)


async def test_no_wait_fails_them_with_the_worker(
        link: LosableLink, closing: list[Engine]) -> None:
    engine, running, waiting = await started(link, EngineConfig(worker_reconnect_s=0))
    closing.append(engine)
    link.lose()
    for stream in [running, *waiting]:
        assert isinstance((await events_of(stream))[1], errors.Unavailable)


@pytest.mark.parametrize("bug", [KeyError("a bug"), errors.InvalidArgument("a bug")])
async def test_a_bug_in_the_step_loop_ends_every_request_and_the_engine_for_good(
        link: LosableLink, closing: list[Engine], monkeypatch: pytest.MonkeyPatch,
        bug: Exception) -> None:
    """Not taken for a lost worker: reconnecting would only meet the bug
    again, failing requests and flapping the health every retry. (The
    core's own InvalidArgument was taken for a worker's bad answer.)"""
    engine, running, waiting = await started(link, EngineConfig(worker_reconnect_s=30))
    closing.append(engine)
    opened = []
    monkeypatch.setattr(link, "open", lambda: opened.append(1) or LosableStream())

    def schedule(self: Scheduler) -> None:
        raise bug

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    failure = await asyncio.wait_for(engine.wait_failed(), 10)
    assert failure is bug
    for stream in [running, *waiting]:
        _, end = await events_of(stream)
        assert isinstance(end, errors.Unavailable) and "a bug" in str(end)
    assert not engine.worker_up
    with pytest.raises(errors.Unavailable, match=r"the scheduler failed .* and restarts"):
        await engine.admit("late", PROMPT, SamplingParams(max_tokens=3))
    await asyncio.sleep(0.1)
    assert opened == []  # no new stream: the step loop ended


async def test_a_worker_answering_a_token_outside_the_vocabulary_is_lost_not_believed(
        link: LosableLink, closing: list[Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """The requests it held fail, the others wait, and a new stream goes on."""
    engine, running, waiting = await started(link, EngineConfig(worker_reconnect_s=30))
    closing.append(engine)

    answer = LosableStream.step
    answered: list[int] = []

    async def once_nonsense(self: LosableStream, output: SchedulerOutput) -> dict[str, int]:
        if answered:
            return await answer(self, output)
        answered.append(1)
        return {seq.request_id: 10**6 for seq in output.seqs if seq.sample}

    monkeypatch.setattr(LosableStream, "step", once_nonsense)
    _, end = await events_of(running)
    assert isinstance(end, errors.Unavailable) and "outside the vocabulary" in str(end)
    assert engine.failure is None
    for stream in waiting:
        assert await events_of(stream) == ([7, 7, 7], RequestStatus.FINISHED_LENGTH)


async def test_a_task_beside_the_step_loop_that_raises_ends_the_engine_for_good() -> None:
    """An offload whose link raises, breaking its contract (it reports every
    failure as an outcome): a bug beside the loop, which ends the engine as
    one in the loop does."""
    class BuggyLink(FakeWorkerLink):
        async def offload(self, cmd: OffloadCommand, timeout_s: float) -> CopyOutcome:
            raise ValueError("a bug in the link")

    engine = Engine(pressured_core(PreemptionMode.OFFLOAD), BuggyLink(),  # type: ignore[arg-type]
                    None)
    await engine.start()
    try:
        streams = [engine.submit(rid, prompt, SamplingParams(max_tokens, ignore_eos=True))
                   for rid, prompt, max_tokens in (("a", [1, 2], 6), ("b", [40, 41, 42, 43], 4))]
        failure = await asyncio.wait_for(engine.wait_failed(), 10)
        assert "a task beside the step loop failed" in str(failure)
        assert isinstance(failure.__cause__, ValueError)
        for stream in streams:
            _, end = await events_of(stream)
            assert isinstance(end, errors.Unavailable) and "a bug in the link" in str(end)
    finally:
        await engine.close()


async def test_a_task_that_raises_while_the_worker_is_away_ends_the_engine_at_once(
        link: LosableLink, closing: list[Engine]) -> None:
    """The loop waits for the worker then, and would raise it only once back."""
    engine, _, waiting = await started(link, EngineConfig(worker_reconnect_s=30))
    closing.append(engine)
    link.lose()
    async with asyncio.timeout(10):
        while engine.worker_up:
            await asyncio.sleep(0.005)

    async def bug() -> None:
        raise KeyError("a bug beside the loop")

    engine._tasks.spawn(bug())  # as a copy task would
    failure = await asyncio.wait_for(engine.wait_failed(), 10)
    assert isinstance(failure.__cause__, KeyError)
    for stream in waiting:
        assert isinstance((await events_of(stream))[1], errors.Unavailable)


@pytest.mark.parametrize("seconds", [-1.0, math.inf, math.nan])
def test_the_bound_is_a_finite_number_of_seconds(seconds: float) -> None:
    with pytest.raises(ValueError, match="worker_reconnect_s"):
        EngineConfig(worker_reconnect_s=seconds)


@pytest.mark.parametrize("bad", ["0", "-1", "inf", "nan"])
def test_a_step_timeout_that_is_no_time_is_refused_at_start(bad: str) -> None:
    with pytest.raises(SystemExit, match="step_timeout_s must be a finite number of seconds > 0"):
        scheduler_main(["--step-timeout", bad])
