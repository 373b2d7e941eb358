"""A request as the scheduler sees it: tokens, progress, blocks, status.

Token layout and what the KV cache holds (block_size 4, decode phase):

    positions  0 1 2 3 | 4 5 6 7 | 8 9
    tokens     p p p p | p p o o | o o          prompt p (tuple), output o (list)
    KV         x x x x | x x x x | x .          num_computed_tokens = 9
    blocks     [  b0   ] [  b1   ] [  b2   ]    block_ids covers >= 9 positions

The last output token has no KV yet: the next decode step computes it and
samples the token after it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstash.common.sampling import SamplingParams
from scheduler_svc.core.seq import ScheduledSeq


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill; holds no blocks
    RUNNING_PREFILL = "running_prefill"  # prompt (+ output, after recompute) being computed
    RUNNING_DECODE = "running_decode"  # one token per step
    OFFLOADING = "offloading"  # preempted; its blocks are being copied to the cache
    OFFLOADED = "offloaded"  # preempted; KV lives only in a snapshot
    RESUMING = "resuming"  # snapshot being copied back into fresh blocks
    # Admitted; prompt segments being copied from the prefix tier into its
    # blocks, then it prefills the rest.
    LOADING = "loading"
    # P/D, decode instance: blocks held for a prefill instance's request
    # until its KV arrives (or the reservation expires).
    RESERVED = "reserved"
    # P/D, prefill instance: prefilled; its blocks are being copied to the
    # cache for a decode instance, which then decodes it while it is HANDED_OFF.
    HANDING_OFF = "handing_off"
    HANDED_OFF = "handed_off"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens reached
    FINISHED_ABORTED = "finished_aborted"  # aborted by the client (or its worker was lost)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


@dataclass(frozen=True, slots=True)
class RequestUsage:
    """A request's figures when it finishes: a copy, for its stream and the metrics."""

    # Tokens in its prompt.
    num_prompt_tokens: int
    # Tokens it generated.
    num_output_tokens: int
    # Times it was preempted (either mode).
    num_preemptions: int
    # Tokens prefilled again after recompute preemptions.
    num_recomputed_tokens: int
    # KV bytes stashed in the cache service over its life.
    bytes_offloaded: int
    # Clock time from arrival to first admission; None if never admitted.
    queue_time_s: float | None
    # Prompt tokens its first admission found in the prefix cache.
    num_cached_tokens: int = 0


@dataclass(slots=True)
class Snapshot:
    """A preempted request's KV stashed in the cache service."""

    # Cache-service key: unique, [A-Za-z0-9._-] only.
    snapshot_id: str
    # Positions of KV it holds (the request's num_computed_tokens at offload).
    num_tokens: int
    # Blocks it fills once restored.
    num_blocks: int
    # Size the cache service committed; 0 while the copy is in flight.
    num_bytes: int = 0
    # P/D, decode instance: a prefill instance's hand-off, not this one's offload.
    handed_in: bool = False


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    # Never assigned after construction; read through `prompt_token_ids`.
    _prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # Clock value when the request was added.
    arrival_time: float
    # Order of arrival, for keeping preempted requests in their original order.
    arrival_seq: int
    # Tokens that finish the request: stop_token_ids plus EOS unless ignore_eos.
    stop_ids: frozenset[int]
    status: RequestStatus = RequestStatus.WAITING
    # Generated tokens; the prompt is never extended.
    output_token_ids: list[int] = field(default_factory=list)
    # Positions whose KV is in this request's blocks (see module picture).
    num_computed_tokens: int = 0
    # Block table: block_ids[i] holds positions [i * block_size, (i + 1) * block_size).
    block_ids: list[int] = field(default_factory=list)
    # Prefix hash of each full block of prompt + output, computed lazily (KV manager).
    block_hashes: list[int] = field(default_factory=list)
    # Leading blocks of block_ids registered in the prefix cache (KV manager).
    num_cached_blocks: int = 0
    # Prompt tokens its first admission found in the prefix cache (the prefix
    # tier's included).
    num_cached_tokens: int = 0
    # Leading segments of its prompt the prefix tier held at arrival
    # (prefix_tier.py); 0 without one. Known only where the tier answered
    # that lookup.
    stored_segments: int = 0
    tier_answered: bool = True
    # Re-prefilling positions below this counts as recomputation (set on a
    # recompute preemption to the positions that had KV; 0 otherwise).
    recompute_until: int = 0
    # Where the KV lives while OFFLOADING / OFFLOADED / RESUMING (and, P/D,
    # HANDING_OFF / HANDED_OFF); written only by Lifecycle.
    snapshot: Snapshot | None = None
    # Times this request was preempted (either mode).
    num_preemptions: int = 0
    # Tokens prefilled again after recompute preemptions.
    num_recomputed_tokens: int = 0
    # KV bytes stashed in the cache service over the request's life.
    bytes_offloaded: int = 0
    # Clock value when the request was first admitted (its queue time ends).
    first_scheduled_time: float | None = None
    # Clock value when the first output token arrived.
    first_token_time: float | None = None
    # P/D: clock value when the RESERVED blocks go back (decode instance).
    reserved_until: float = 0.0
    # P/D, decode instance: a prefill instance's request (reserved for it).
    # Ended here other than by finishing (aborted, expired), it counts as
    # finished there, where its client's call ends.
    remote: bool = False
    # Its decode work item, refreshed in place by every schedule() that decodes
    # it rather than rebuilt: rebuilding more than doubles schedule() at 1024
    # decodes (0.16 -> 0.38 ms on the 2-core machine, bench/scheduler_bench.py).
    decode_seq: ScheduledSeq | None = None

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        arrival_time: float,
        arrival_seq: int,
        eos_token_ids: Sequence[int] = (),
        status: RequestStatus = RequestStatus.WAITING,
    ) -> Request:
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.update(eos_token_ids)
        return cls(
            request_id=request_id,
            _prompt_token_ids=tuple(prompt_token_ids),
            sampling=sampling,
            arrival_time=arrival_time,
            arrival_seq=arrival_seq,
            stop_ids=frozenset(stop_ids),
            status=status,
        )

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self._prompt_token_ids

    @property
    def snapshot_id(self) -> str | None:
        return None if self.snapshot is None else self.snapshot.snapshot_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output."""
        return len(self._prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Output tokens still allowed by max_tokens."""
        return self.sampling.max_tokens - len(self.output_token_ids)

    def usage(self) -> RequestUsage:
        queue_time_s = (None if self.first_scheduled_time is None
                        else self.first_scheduled_time - self.arrival_time)
        return RequestUsage(
            self.num_prompt_tokens, len(self.output_token_ids), self.num_preemptions,
            self.num_recomputed_tokens, self.bytes_offloaded, queue_time_s,
            self.num_cached_tokens,
        )

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output."""
        prompt = self._prompt_token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            return list(prompt[start:end])
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return [*prompt[start:], *self.output_token_ids[: end - num_prompt]]
