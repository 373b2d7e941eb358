"""A request's work in one step (what the worker computes for it)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstash.common.sampling import SamplingParams


@dataclass(slots=True)
class ScheduledSeq:
    """One request's work in a step.

    Prefill chunk of prompt (+ output, after a recompute):
        token_ids = tokens[start_pos : start_pos + n], sample on the last chunk only
    Decode:
        token_ids = [output[-1]], start_pos = len(prompt) + len(output) - 1, sample
    """

    # The request this work belongs to.
    request_id: str
    # Tokens whose KV this step computes, at positions start_pos, start_pos + 1, ...
    token_ids: list[int]
    # Position of token_ids[0].
    start_pos: int
    # The request's whole block table: the core's own list, not a copy (a step
    # schedules every running request, and copying each table would cost more
    # than the rest of schedule()); read-only, valid until the next schedule().
    block_ids: list[int]
    # Whether this step samples a token for the request (decode, or the chunk
    # that completes the prefill).
    sample: bool
    # How to sample it.
    sampling: SamplingParams
