"""A request's stream: what its Generate call reads, fed by the engine after
each step; and fan_in, which reads several (the n sequences of one call)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from opentelemetry import context as otel_context

from kvstash import errors
from scheduler_svc import tracing
from scheduler_svc.core.outputs import RequestUpdate
from scheduler_svc.core.request import RequestStatus, RequestUsage

T = TypeVar("T")


@dataclass(slots=True)
class RequestStream:
    """Token updates as the steps produce them, then the end: a finishing
    update, or an error."""

    events: asyncio.Queue[RequestUpdate | errors.KvstashError] = field(
        default_factory=asyncio.Queue)
    # How it ended (FINISHED_*), set with its last event, and its figures.
    finish_status: RequestStatus | None = None
    usage: RequestUsage | None = None
    # The context the request was submitted in (its Generate span) and its
    # phase spans; None unless tracing is on.
    trace_context: otel_context.Context | None = None
    phases: tracing.RequestPhases | None = None
    # Set at its first tokens (its prompt's KV is then computed) or its end.
    begun: asyncio.Event = field(default_factory=asyncio.Event)
    # False for a request aborted before the core took it: the core's
    # finished_requests never counts it, so the per-request metrics do not.
    admitted: bool = True

    @classmethod
    def aborted_unadmitted(cls, request_id: str, num_prompt_tokens: int) -> RequestStream:
        """The stream of a request aborted before the core took it: its end
        only (nothing ran)."""
        stream = cls(admitted=False)
        stream.end(RequestUpdate(request_id, [], RequestStatus.FINISHED_ABORTED, RequestUsage(
            num_prompt_tokens, num_output_tokens=0, num_preemptions=0, num_recomputed_tokens=0,
            bytes_offloaded=0, queue_time_s=None)))
        return stream

    @property
    def finished(self) -> bool:
        """Its last event is queued."""
        return self.finish_status is not None

    def push(self, update: RequestUpdate) -> None:
        """A step's update; one that finishes the request ends the stream."""
        if update.new_token_ids:
            self.begun.set()
        if self.phases is not None and update.new_token_ids:
            self.phases.produced()
        if update.finish_status is not None:
            self.end(update)
        else:
            self.events.put_nowait(update)

    def end(self, update: RequestUpdate) -> None:
        assert update.finish_status is not None, "an end names how it ended"
        self.begun.set()
        self.finish_status = update.finish_status
        self.usage = update.usage
        self.events.put_nowait(update)
        if self.phases is not None:
            self.phases.end(update.finish_status.name)

    def fail(self, error: errors.KvstashError, usage: RequestUsage | None) -> None:
        """Ends the stream with `error` (the request was aborted for it)."""
        self.begun.set()
        self.finish_status = RequestStatus.FINISHED_ABORTED
        self.usage = usage
        self.events.put_nowait(error)
        if self.phases is not None:
            self.phases.end("error")


_DONE = object()  # a source of fan_in ran out


async def fan_in(sources: Sequence[AsyncGenerator[T, None]]
                 ) -> AsyncGenerator[tuple[int, T], None]:
    """(index of the source, item) from every source as items come; the first
    exception a source raises is raised here. Every source is closed when
    this ends, however it ends (a closed source's `finally` runs at once)."""
    if len(sources) == 1:  # the common case needs no tasks
        async with contextlib.aclosing(sources[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | Exception | object] = asyncio.Queue()

    async def pump(index: int, source: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(source):
                async for item in source:
                    queue.put_nowait((index, item))
        except Exception as exc:  # raised in fan_in's caller
            queue.put_nowait(exc)
        else:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        running = len(tasks)
        while running:
            got = await queue.get()
            if got is _DONE:
                running -= 1
            elif isinstance(got, Exception):
                raise got
            else:
                yield got  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
