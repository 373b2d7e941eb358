"""bench.replay's sending loop and senders, against fake servers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bench.replay import drive
from bench.replay.drive import replay
from kvstash.workload.metrics import RequestRecord, Slo, summarize
from kvstash.workload.trace import Trace, TraceRequest


def test_latencies_count_from_the_arrival_even_when_sent_late() -> None:
    # Two requests due at once; the first one's send holds the event loop
    # for 0.2 s, so the second goes out late: that wait is queueing its
    # TTFT must show, as a server's queue would.
    trace = Trace((TraceRequest(0.0, 4, 1, (0,)), TraceRequest(0.0, 4, 1, (1,))), 4)

    async def send(record: RequestRecord, prompt: list[int], max_tokens: int) -> None:
        if record.index == 0:
            time.sleep(0.2)  # noqa: ASYNC251 - the point: a busy loop
        record.chunk_times.append(time.perf_counter())
        record.num_tokens, record.ended_s = 1, time.perf_counter()

    records = asyncio.run(replay(trace, [[1] * 4, [2] * 4], send))
    assert records[1].sent_s == pytest.approx(records[0].sent_s, abs=0.05)
    assert records[1].ttft_s is not None and records[1].ttft_s >= 0.2


def test_a_request_that_finished_short_of_its_length_failed() -> None:
    """Sent with EOS ignored for its trace length, a request finished by
    "length" with fewer tokens (or more) than that did not complete: not
    counted as good, nor its output left unchecked by the oracle."""
    trace = Trace(tuple(TraceRequest(0.0, 4, 3, (i,)) for i in range(3)), 4)

    async def send(record: RequestRecord, prompt: list[int], max_tokens: int) -> None:
        for _ in range(max_tokens - 1 + record.index):  # 2, 3 and 4 tokens
            record.chunk_times.append(time.perf_counter())
            record.num_tokens += 1
        record.ended_s = time.perf_counter()

    records = asyncio.run(replay(trace, [[1] * 4] * 3, send))
    assert [(r.ok, r.error) for r in records] == [(False, "WRONG_LENGTH"), (True, None),
                                                   (False, "WRONG_LENGTH")]
    assert not Slo(1e9, 1e9).met(records[0])


def test_a_request_never_finished_is_cancelled_and_failed_at_its_timeout() -> None:
    """A server that never finishes a request (a stall) fails that request
    once it is `timeout_s` past its arrival, its stream cancelled, instead
    of hanging the replay; the others are untouched."""
    trace = Trace((TraceRequest(0.0, 4, 1, (0,)), TraceRequest(0.0, 4, 1, (1,))), 4)
    cancelled = []

    async def send(record: RequestRecord, prompt: list[int], max_tokens: int) -> None:
        record.chunk_times.append(time.perf_counter())
        record.num_tokens = 1
        if record.index == 0:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(record.index)
                raise
        record.ended_s = time.perf_counter()

    records = asyncio.run(asyncio.wait_for(replay(trace, [[1] * 4] * 2, send, timeout_s=0.3),
                                           60))
    assert [(r.ok, r.error) for r in records] == [(False, "TIMEOUT"), (True, None)]
    assert cancelled == [0]
    assert records[0].ended_s is not None and records[0].ended_s - records[0].sent_s >= 0.3


@pytest.mark.parametrize(("finish", "error"), [("length", None), ("abort", "FINISH_ABORT"),
                                               ("stop", "FINISH_STOP")])
def test_http_counts_only_a_request_that_ran_its_length(
        monkeypatch: pytest.MonkeyPatch, finish: str, error: str | None) -> None:
    # As over gRPC: the trace asks for its output length with EOS ignored;
    # a stream that ends otherwise (aborted by the server) did not complete.
    async def events(url: str, body: dict[str, object]) -> AsyncIterator[dict[str, Any]]:
        yield {"choices": [{"text": "a", "finish_reason": None}]}
        yield {"choices": [{"text": "b", "finish_reason": finish}]}
        yield {"choices": [], "usage": {"completion_tokens": 2}}

    monkeypatch.setattr(drive, "sse_events", events)
    record = RequestRecord(0, time.perf_counter(), output=[])
    async def send() -> None:
        await drive.http_sender("http://x", "tiny")(record, [65, 66], 2)

    asyncio.run(send())
    assert (record.error, record.ok, record.output, record.num_tokens) == \
        (error, error is None, "ab", 2)


def test_a_request_that_failed_last_ends_the_runs_wall_time() -> None:
    """Goodput and requests/s are over the run's wall time, to the last
    request ended: one that failed ended too (when its error came back), or
    a run whose last requests failed would count a shorter run, and its
    rates would be too high."""
    trace = Trace((TraceRequest(0.0, 4, 1, (0,)), TraceRequest(0.0, 4, 1, (1,)),
                   TraceRequest(0.0, 4, 1, (2,))), 4)

    async def send(record: RequestRecord, prompt: list[int], max_tokens: int) -> None:
        if record.index == 0:
            record.chunk_times.append(time.perf_counter())
            record.num_tokens, record.ended_s = 1, time.perf_counter()
            return
        await asyncio.sleep(0.5)
        if record.index == 1:
            record.error = "Unavailable"  # as grpc_sender records a failed call
        else:
            record.chunk_times.append(time.perf_counter())  # no finish came

    records = asyncio.run(replay(trace, [[1] * 4] * 3, send))
    s = summarize(records, Slo(1e9, 1e9))
    assert s.wall_s >= 0.5 and s.num_completed == 1
    assert s.requests_per_s <= 1 / 0.5
    assert s.errors == {"Unavailable": 1, "UNFINISHED": 1}
