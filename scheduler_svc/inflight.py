"""The edge's one record per in-flight request, and the engine's background tasks.

    InFlight     a request the core holds, as the edge sees it: the stream its
                 call reads and, on a P/D prefill instance, its hand-off (the
                 task finding a decode instance and relaying its tokens, once
                 handed off)
    InFlightRequests  request id -> InFlight: `open` is the one place a record
                 is made, `close` the one place it is dropped; and the requests
                 being admitted (`admitting`: awaiting the prefix tier or a
                 decode instance's reservation), which an Abort may end before
                 the core has them
    Tasks        every task the engine runs beside its step loop (copies,
                 deletes, hand-offs, releases), cancelled together at close

The records hold exactly the core's live requests but the RESERVED ones (a
decode instance's reservations, which no call reads yet): `check` says so,
and the engine runs it with its integrity check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context

from kvstash.errors import AlreadyExists, IntegrityError
from scheduler_svc import tracing
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.streams import RequestStream

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Handoff:
    """Where a prefill instance's request decodes (P/D)."""

    # The task finding a decode instance and relaying its tokens, once the
    # request is handed off; cancelling it aborts the request there.
    relay: asyncio.Task[None] | None = None


@dataclass(slots=True)
class InFlight:
    stream: RequestStream
    # Set from admission until the request no longer decodes elsewhere
    # (decoding here, or its relay ended); always None on other roles.
    handoff: Handoff | None = None

    @property
    def relayed(self) -> bool:
        """It decodes on a decode instance: this worker is no longer needed."""
        return self.handoff is not None and self.handoff.relay is not None


@dataclass(slots=True)
class Admission:
    """A request between its checks and the core taking it."""

    aborted: bool = False  # an Abort named it meanwhile: it must not run


class InFlightRequests:
    def __init__(self, tracing_on: bool) -> None:
        """`tracing_on`: each stream keeps the trace context it was opened in."""
        self._tracing_on = tracing_on
        self._req_to_record: dict[str, InFlight] = {}
        self._admitting: dict[str, Admission] = {}

    @contextlib.contextmanager
    def admitting(self, request_id: str) -> Iterator[Admission]:
        """Marks a request as being admitted for the block's length
        (AlreadyExists while one of its id is admitted or live)."""
        if request_id in self._admitting or request_id in self._req_to_record:
            raise AlreadyExists(f"request {request_id} already exists")
        admission = self._admitting[request_id] = Admission()
        try:
            yield admission
        finally:
            del self._admitting[request_id]

    def abort_admission(self, request_id: str) -> bool:
        """Marks a request being admitted as aborted; False if none is."""
        admission = self._admitting.get(request_id)
        if admission is not None:
            admission.aborted = True
        return admission is not None

    def open(self, request_id: str, handoff: Handoff | None = None,
             prefilled: bool = False) -> RequestStream:
        """The record of a request the core just took; its stream.
        `prefilled`: a decode instance's, whose prompt was computed on its
        prefill instance (tracing.RequestPhases)."""
        stream = RequestStream()
        if self._tracing_on:
            stream.trace_context = otel_context.get_current()
            stream.phases = tracing.RequestPhases(stream.trace_context, prefilled)
        self._req_to_record[request_id] = InFlight(stream, handoff)
        return stream

    def close(self, request_id: str) -> InFlight | None:
        """Drops the record of a request the core no longer holds (None: it
        had none, or was dropped already)."""
        return self._req_to_record.pop(request_id, None)

    def get(self, request_id: str) -> InFlight | None:
        return self._req_to_record.get(request_id)

    def stream(self, request_id: str) -> RequestStream | None:
        record = self._req_to_record.get(request_id)
        return None if record is None else record.stream

    def trace_context(self, request_id: str) -> otel_context.Context | None:
        """The request's trace context: None unless tracing is on and it is live."""
        if not self._tracing_on or (record := self._req_to_record.get(request_id)) is None:
            return None
        return record.stream.trace_context

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._req_to_record))

    def __len__(self) -> int:
        return len(self._req_to_record)

    def check(self, core: Scheduler) -> None:
        """IntegrityError unless the records are the core's live requests but
        its reservations: none leaked, none lost."""
        for request_id in self._req_to_record:
            if core.get_request(request_id) is None:
                raise IntegrityError(f"request {request_id} has a record at the edge, "
                                     "but the core no longer holds it")
        stats = core.stats()
        num_live = (stats.num_waiting + stats.num_running_prefill + stats.num_running_decode
                    + stats.num_offloaded + stats.num_handed_off + stats.num_loading)
        if num_live != len(self._req_to_record):
            raise IntegrityError(f"the core holds {num_live} requests besides reservations, "
                                 f"the edge has records of {len(self._req_to_record)}")


class Tasks:
    def __init__(self, on_failure: Callable[[BaseException], None]) -> None:
        """`on_failure(exc)`: a task raised `exc`. The tasks handle every
        failure they expect (a copy that failed is reported to the core), so
        one that raises is a bug: a copy the core never heard of keeps its
        blocks pinned for good."""
        self._tasks: set[asyncio.Task[object]] = set()
        self.on_failure = on_failure

    def spawn(self, coro: Coroutine[Any, Any, object], name: str | None = None) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("task %s failed", task.get_name(), exc_info=exc)
            self.on_failure(exc)

    async def close(self, grace_s: float = 0.0) -> None:
        """Cancels every task, after up to `grace_s` for them to end on their
        own, and waits for them."""
        tasks = list(self._tasks)
        if tasks and grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
