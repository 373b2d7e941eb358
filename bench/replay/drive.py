"""Send a trace's requests at their arrival times and record what comes back.

Two ways in: kvstash's own gRPC API (`grpc_sender`) and OpenAI HTTP through
smg (`http_sender`). Each request is greedy, ignores EOS and asks for the
trace's output length, so the work is the trace's and outputs can be
compared across runs. A `Sampler` polls the scheduler's and the cache's
counters meanwhile, for occupancy over time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.client import Client
from kvstash.errors import KvstashError
from kvstash.launch.openai_http import HttpError, StreamError, sse_events
from kvstash.workload.metrics import RequestRecord
from kvstash.workload.trace import Trace

Sender = Callable[[RequestRecord, list[int], int], Awaitable[None]]


def grpc_sender(client: Client) -> Sender:
    async def send(record: RequestRecord, prompt: list[int], max_tokens: int) -> None:
        assert isinstance(record.output, list)
        try:
            async for delta in client.generate(prompt, max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True):
                if delta.token_ids:
                    record.chunk_times.append(time.perf_counter())
                    record.num_tokens += len(delta.token_ids)
                    record.output.extend(delta.token_ids)
                if delta.finish_reason is not None:
                    record.ended_s = time.perf_counter()
                    if delta.finish_reason != "length":
                        record.error = f"FINISH_{delta.finish_reason.upper()}"
        except KvstashError as exc:
            record.error = type(exc).__name__
    return send


def http_sender(url: str, model: str) -> Sender:
    """Streams /v1/completions with the prompt as text (smg takes no token
    ids): the prompt's ids must be bytes of printable ASCII (prompts.ALPHABET)
    and the model's tokenizer the byte one, so the text encodes back to them.
    An event with text counts as one token (smg sends one a token), the usage
    event gives the total. As over gRPC, a finish other than "length" is an
    error: the request asked for its length with EOS ignored."""
    async def send(record: RequestRecord, prompt: list[int], max_tokens: int) -> None:
        body: dict[str, Any] = {
            "model": model, "prompt": bytes(prompt).decode("ascii"), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
        text = ""
        try:
            async for event in sse_events(f"{url}/v1/completions", body):
                if "error" in event:
                    raise StreamError(str(event["error"]))
                now = time.perf_counter()
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        record.chunk_times.append(now)
                        record.num_tokens += 1
                        text += choice["text"]
                    if (reason := choice.get("finish_reason")) is not None:
                        record.ended_s = now
                        if reason != "length":
                            record.error = f"FINISH_{reason.upper()}"
                if event.get("usage"):
                    record.num_tokens = event["usage"]["completion_tokens"]
        except HttpError as exc:
            record.error = f"HTTP_{exc.status}"
        except (StreamError, OSError, asyncio.IncompleteReadError) as exc:
            record.error = type(exc).__name__
        record.output = text
    return send


async def replay(trace: Trace, prompts: Sequence[list[int]], send: Sender,
                 on_done: Callable[[RequestRecord], None] = lambda _: None,
                 timeout_s: float | None = None) -> list[RequestRecord]:
    """Every request sent at its arrival time (from now), all awaited. Its
    latencies count from that arrival, not from when it went out: a replay
    behind schedule (a busy event loop) must not hide the wait as queueing.
    With EOS ignored a request must return exactly the tokens it asked for:
    one that finished with any other number failed (WRONG_LENGTH). A failed
    request ended when its stream did (its error, or UNFINISHED)."""
    if len(prompts) != len(trace.requests):
        raise ValueError(f"{len(prompts)} prompts for {len(trace.requests)} requests")
    start = time.perf_counter()

    async def one(index: int) -> RequestRecord:
        request = trace.requests[index]
        due = start + request.arrival_s
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        record = RequestRecord(index, due, output=[])
        left = None if timeout_s is None else due + timeout_s - time.perf_counter()
        try:
            await asyncio.wait_for(send(record, prompts[index], request.output_length), left)
        except TimeoutError:
            record.error, record.ended_s = "TIMEOUT", None
        if record.ended_s is None:  # failed, or its stream ended without a finish
            record.error = record.error or "UNFINISHED"
            record.ended_s = time.perf_counter()  # so the run's wall time holds it
        if record.ok and record.num_tokens != request.output_length:
            record.error = "WRONG_LENGTH"
        on_done(record)
        return record

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


@dataclass(frozen=True, slots=True)
class Occupancy:
    t_s: float  # from the sampler's start
    used_blocks: int  # held by requests: total - free - evictable
    total_blocks: int
    num_running: int
    num_waiting: int
    num_offloaded: int
    cache_memory_bytes: int
    cache_disk_bytes: int


@dataclass(slots=True)
class Sampler:
    """Polls stats every `interval_s` until stopped; unanswered polls are skipped."""

    client: Client
    cache: CacheClient | None
    interval_s: float = 0.25
    samples: list[Occupancy] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Sampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        start = time.perf_counter()
        while True:
            with contextlib.suppress(KvstashError):
                s = await self.client.stats()
                memory = disk = 0
                if self.cache is not None:
                    c = await self.cache.stats()
                    memory, disk = c.memory_bytes, c.disk_bytes
                self.samples.append(Occupancy(
                    time.perf_counter() - start,
                    s.num_total_blocks - s.num_free_blocks - s.num_evictable_blocks,
                    s.num_total_blocks, s.num_running_prefill + s.num_running_decode,
                    s.num_waiting, s.num_offloaded, memory, disk))
            await asyncio.sleep(self.interval_s)
