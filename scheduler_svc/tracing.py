"""The scheduler's own spans (see kvstash.common.telemetry for setup and the trace shape).

Called by the engine only when tracing is on; every helper takes the request's
trace context (None when it has none) and is a no-op without one.
"""

from __future__ import annotations

import contextlib

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import Attributes

from scheduler_svc.core.outputs import OffloadCommand, Preempted, PrefixLoad, RestoreCommand

_tracer = trace.get_tracer("kvstash.scheduler")


class RequestPhases:
    """A request's time in the scheduler as consecutive spans of its own trace:

        Generate ─┬─ kvstash.queued ── kvstash.prefill ── kvstash.decode ─┐
                  │  (submitted ->      (-> first token)   (-> finished)   │
                  │   first scheduled)                                     │
                  └─ kvstash.offload / kvstash.restore (when preempted) ───┘

    Steps are not spans: a step serves many requests, and a span per step
    would be a trace of its own (hundreds per second, each one span). Step
    timing is the worker's step histogram; here each phase counts its steps.
    A request preempted by recompute prefills again inside its decode span
    (the Generate span's "preempted" event marks when). A decode instance's
    part of a P/D request (`prefilled`: its prompt was computed on the
    prefill instance) is one kvstash.decode span, under its Decode call,
    from the restore of its KV to its end."""

    __slots__ = ("_context", "_name", "_num_steps", "_span")

    def __init__(self, context: otel_context.Context, prefilled: bool = False) -> None:
        self._context = context
        self._name: str | None = None  # of the open span; None once ended
        self._span: trace.Span | None = None
        self._num_steps = 0  # steps the open phase has been scheduled in
        self._next("kvstash.decode" if prefilled else "kvstash.queued")

    def scheduled(self) -> None:
        """The request is in this step's batch."""
        if self._name == "kvstash.queued":
            self._next("kvstash.prefill")
        self._num_steps += 1

    def produced(self) -> None:
        """The request got a token."""
        if self._name == "kvstash.prefill":
            self._next("kvstash.decode")

    def end(self, outcome: str) -> None:
        if self._span is not None:
            self._span.set_attribute("kvstash.outcome", outcome)
        self._next(None)

    def _next(self, name: str | None) -> None:
        if self._span is not None:
            self._span.set_attribute("kvstash.num_steps", self._num_steps)
            self._span.end()
        self._num_steps = 0
        self._name = name
        self._span = None if name is None else _tracer.start_span(name, context=self._context)


def transfer_span(
    trace_context: otel_context.Context | None, name: str, cmd: OffloadCommand | RestoreCommand
) -> contextlib.AbstractContextManager[trace.Span]:
    """A span for one offload or restore in the request's own trace, current
    while the transfer runs so the worker call carries the context."""
    if trace_context is None:
        return contextlib.nullcontext(trace.INVALID_SPAN)
    return _tracer.start_as_current_span(
        name, context=trace_context, record_exception=False, attributes={
            "kvstash.request_id": cmd.request_id, "kvstash.snapshot_id": cmd.snapshot_id,
            "kvstash.num_blocks": len(cmd.block_ids),
        })


def prefix_lookup_span(
    on: bool, num_segments: int
) -> contextlib.AbstractContextManager[trace.Span]:
    """A span for asking the cache which of a new request's prompt segments
    it holds, in the current context (the request's Generate call)."""
    if not on:
        return contextlib.nullcontext(trace.INVALID_SPAN)
    return _tracer.start_as_current_span(
        "kvstash.prefix_lookup", record_exception=False,
        attributes={"kvstash.num_segments": num_segments})


def prefix_load_span(
    trace_context: otel_context.Context | None, load: PrefixLoad
) -> contextlib.AbstractContextManager[trace.Span]:
    """A span for one prefix-tier load (its segments' reads), as transfer_span."""
    if trace_context is None:
        return contextlib.nullcontext(trace.INVALID_SPAN)
    return _tracer.start_as_current_span(
        "kvstash.prefix_load", context=trace_context, record_exception=False, attributes={
            "kvstash.request_id": load.request_id,
            "kvstash.num_segments": len(load.segments),
            "kvstash.num_blocks": sum(len(s.block_ids) for s in load.segments),
            **({} if load.predicted_load_s is None else
               {"kvstash.predicted_load_s": load.predicted_load_s}),
            **({} if load.predicted_prefill_s is None else
               {"kvstash.predicted_prefill_s": load.predicted_prefill_s}),
        })


def request_event(
    trace_context: otel_context.Context | None, name: str, attributes: Attributes
) -> None:
    """An event on the request's own (Generate) span."""
    if trace_context is not None:
        trace.get_current_span(trace_context).add_event(name, attributes)


def preempted(trace_context: otel_context.Context | None, choice: Preempted) -> None:
    """The "preempted" event: the mode chosen, why, and what it weighed (the
    predictions only once the cost model has them)."""
    if trace_context is None:
        return
    attributes: dict[str, str | int | float] = {
        "mode": choice.mode.value, "reason": choice.reason.value,
        "num_tokens": choice.num_tokens, "num_blocks": choice.num_blocks,
    }
    if choice.offload_restore_s is not None:
        attributes["predicted_offload_restore_s"] = choice.offload_restore_s
    if choice.recompute_s is not None:
        attributes["predicted_recompute_s"] = choice.recompute_s
    request_event(trace_context, "preempted", attributes)


def set_copied(span: trace.Span, num_bytes: int) -> None:
    span.set_attributes({"kvstash.bytes": num_bytes, "kvstash.outcome": "copied"})


def set_failed(span: trace.Span, description: str, fallback: str = "recompute") -> None:
    """Marks a transfer span failed, with what happens instead: the request
    recomputes (offload, restore), prefills (a prefix load) or nothing does
    (a prefix save: the segment is just not stored)."""
    span.set_attribute("kvstash.outcome", fallback)
    span.set_status(trace.StatusCode.ERROR, description)
