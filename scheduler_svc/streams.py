"""A request's stream: what its Generate call reads, fed by the engine after each step."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from opentelemetry import context as otel_context

from kvstash import errors
from scheduler_svc import tracing
from scheduler_svc.core.outputs import RequestUpdate
from scheduler_svc.core.request import RequestStatus, RequestUsage


@dataclass(slots=True)
class RequestStream:
    """Token updates as the steps produce them, then the end: a finishing
    update, or an error."""

    events: asyncio.Queue[RequestUpdate | errors.KvstashError] = field(
        default_factory=asyncio.Queue)
    # Set once the last event is queued.
    finished: bool = False
    # How it ended (FINISHED_*) and its figures, once finished.
    finish_status: RequestStatus | None = None
    usage: RequestUsage | None = None
    # The context the request was submitted in (its Generate span) and its
    # phase spans; None unless tracing is on.
    trace_context: otel_context.Context | None = None
    phases: tracing.RequestPhases | None = None

    def push(self, update: RequestUpdate) -> None:
        """A step's update; one that finishes the request ends the stream."""
        if self.phases is not None and update.new_token_ids:
            self.phases.produced()
        if update.finish_status is not None:
            self.end(update)
        else:
            self.events.put_nowait(update)

    def end(self, update: RequestUpdate) -> None:
        self.finished = True
        self.finish_status = update.finish_status
        self.usage = update.usage
        self.events.put_nowait(update)
        if self.phases is not None and update.finish_status is not None:
            self.phases.end(update.finish_status.name)

    def fail(self, error: errors.KvstashError, usage: RequestUsage | None) -> None:
        """Ends the stream with `error` (the request was aborted for it)."""
        self.finished = True
        self.finish_status = RequestStatus.FINISHED_ABORTED
        self.usage = usage
        self.events.put_nowait(error)
        if self.phases is not None:
            self.phases.end("error")
