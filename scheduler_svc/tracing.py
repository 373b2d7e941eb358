"""The scheduler's own spans (see kvstash.telemetry for setup and the trace shape).

Called by the engine only when tracing is on; every helper takes the request's
trace context (None when it has none) and is a no-op without one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace

from scheduler_svc.outputs import OffloadCommand, RestoreCommand, SchedulerOutput

_tracer = trace.get_tracer("kvstash.scheduler")


def step_span(
    output: SchedulerOutput, trace_contexts: Sequence[otel_context.Context | None]
) -> trace.Span:
    """A root span per step: a step serves many requests, so it links to their
    traces instead of belonging to one."""
    links = []
    for ctx in trace_contexts:
        if ctx is not None:
            span_context = trace.get_current_span(ctx).get_span_context()
            if span_context.is_valid:
                links.append(trace.Link(span_context))
    return _tracer.start_span(
        "kvstash.step", context=otel_context.Context(), links=links, attributes={
            "kvstash.step_id": output.step_id,
            "kvstash.num_seqs": len(output.seqs),
            "kvstash.num_scheduled_tokens": output.num_scheduled_tokens,
            "kvstash.num_offloads": len(output.offloads),
            "kvstash.num_restores": len(output.restores),
        })


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


def request_event(
    trace_context: otel_context.Context | None, name: str, attributes: dict[str, str]
) -> None:
    """An event on the request's own (Generate) span."""
    if trace_context is not None:
        trace.get_current_span(trace_context).add_event(name, attributes)


def set_failed(span: trace.Span, description: str) -> None:
    """Marks a transfer span failed: the request falls back to recompute."""
    span.set_attribute("kvstash.outcome", "recompute")
    span.set_status(trace.StatusCode.ERROR, description)
