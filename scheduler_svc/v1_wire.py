"""kvstash.v1 Scheduler messages <-> the scheduler's domain values, both ways,
one table per concept: what the servicer sends (server.py) and what a
prefill instance reads back from its decode instances (decode_peers.py).
"""

from __future__ import annotations

from kvstash.v1 import scheduler_pb2
from scheduler_svc.core.request import RequestStatus, RequestUsage

# How a request ended, as the protocol names it.
FINISH_REASON: dict[RequestStatus, scheduler_pb2.FinishReason.ValueType] = {
    RequestStatus.FINISHED_STOPPED: scheduler_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: scheduler_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: scheduler_pb2.FINISH_REASON_ABORT,
}
FINISH_STATUS: dict[scheduler_pb2.FinishReason.ValueType, RequestStatus] = {
    reason: status for status, reason in FINISH_REASON.items()}


def usage_to_proto(usage: RequestUsage, ttft_s: float) -> scheduler_pb2.Usage:
    return scheduler_pb2.Usage(
        prompt_tokens=usage.num_prompt_tokens, completion_tokens=usage.num_output_tokens,
        num_preemptions=usage.num_preemptions, num_recomputed_tokens=usage.num_recomputed_tokens,
        bytes_offloaded=usage.bytes_offloaded, ttft_s=ttft_s,
    )


def usage_from_proto(usage: scheduler_pb2.Usage) -> RequestUsage:
    """What a decode instance reports of its part of a request (its cached
    tokens are no figure of this instance's)."""
    return RequestUsage(usage.prompt_tokens, usage.completion_tokens, usage.num_preemptions,
                        usage.num_recomputed_tokens, usage.bytes_offloaded, None)
