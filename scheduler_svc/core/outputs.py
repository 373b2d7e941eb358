"""Contracts between the scheduler core and the engine that drives it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler_svc.core.config import PreemptionMode
from scheduler_svc.core.request import RequestStatus, RequestUsage
from scheduler_svc.core.seq import ScheduledSeq


@dataclass(slots=True)
class OffloadCommand:
    """Copy a preempted request's blocks into a cache-service snapshot.

    The blocks stay allocated (nobody else may write them) until the engine
    reports back with `Scheduler.finish_offload`.
    """

    # The preempted request.
    request_id: str
    # Key to store the snapshot under.
    snapshot_id: str
    # Blocks to copy, in order; they hold positions [0, num_tokens).
    block_ids: list[int]
    # Positions of KV to keep.
    num_tokens: int


@dataclass(slots=True)
class RestoreCommand:
    """Copy a snapshot back into freshly allocated blocks.

    Answered with `Scheduler.finish_restore(command, ...)`; the request is
    not scheduled until then. A successful restore consumes the snapshot.
    """

    # The request being resumed.
    request_id: str
    # Snapshot to read.
    snapshot_id: str
    # Target blocks, in order (as many as the snapshot holds).
    block_ids: list[int]


class PreemptReason(enum.Enum):
    """Why a victim's KV is offloaded or dropped."""

    FORCED = "forced"  # preemption_mode OFFLOAD or RECOMPUTE
    CHEAPER = "cheaper"  # AUTO: predicted cheaper than the other way
    NO_ESTIMATE = "no_estimate"  # AUTO: offloads until both ways are measured
    CACHE_UNAVAILABLE = "cache_unavailable"  # AUTO: recomputes while the cache is down


@dataclass(frozen=True, slots=True)
class Preempted:
    """One victim of a step's preemption: what happens to its KV, and why."""

    # The preempted request.
    request_id: str
    # OFFLOAD or RECOMPUTE, never AUTO.
    mode: PreemptionMode
    # Why that mode.
    reason: PreemptReason
    # Positions whose KV it held: what recomputing prefills again.
    num_tokens: int
    # Blocks holding them: what an offload copies and a restore fills.
    num_blocks: int
    # Predicted seconds of offload + restore, and of recompute (in every mode);
    # None until measured (core/costs.py).
    offload_restore_s: float | None
    recompute_s: float | None


@dataclass(slots=True)
class SchedulerOutput:
    """Everything one `schedule()` call decided."""

    # Increases by one per schedule() call; update() must get the latest one.
    step_id: int
    # Work for the model this step: decodes first, then prefill chunks.
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # Snapshots to take (preempted decode requests).
    offloads: list[OffloadCommand] = field(default_factory=list)
    # Snapshots to bring back (resuming requests).
    restores: list[RestoreCommand] = field(default_factory=list)
    # Sum of len(seq.token_ids): never above max_num_batched_tokens.
    num_scheduled_tokens: int = 0
    # P/D: prefilled requests whose blocks to copy for a decode instance.
    handoffs: list[OffloadCommand] = field(default_factory=list)
    # seqs[:num_decodes] are decodes.
    num_decodes: int = 0
    # Every request preempted this step, either mode, in the order chosen.
    preempted: list[Preempted] = field(default_factory=list)


@dataclass(slots=True)
class RequestUpdate:
    """What a step produced for one request, for streaming to its client."""

    # The request.
    request_id: str
    # Tokens appended to its output this step (the stop token included).
    new_token_ids: list[int]
    # FINISHED_STOPPED / FINISHED_LENGTH when it finished now (FINISHED_ABORTED
    # on the update that ends an aborted request's stream), else None.
    finish_status: RequestStatus | None = None
    # Its figures, with finish_status.
    usage: RequestUsage | None = None
    # Prompt tokens its first admission found in the prefix cache (as in
    # usage), on every update: what a vLLM stream chunk reports.
    num_cached_tokens: int = 0


@dataclass(slots=True)
class Counters:
    """The scheduler's cumulative figures, reported in SchedulerStats (see its fields)."""

    num_preemptions_offload: int = 0
    num_preemptions_recompute: int = 0
    num_offload_failures: int = 0
    num_restore_failures: int = 0
    num_recomputed_tokens: int = 0
    num_finished: int = 0
    bytes_offloaded: int = 0
    bytes_restored: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_reservations_accepted: int = 0
    num_reservations_refused: int = 0
    num_reservations_expired: int = 0
    num_handoffs: int = 0
    num_handoff_failures: int = 0
    bytes_handed_off: int = 0


@dataclass(slots=True)
class SchedulerStats:
    """Point-in-time counters; the service exports them as metrics."""

    # Blocks in the pool.
    num_total_blocks: int
    # Tokens per block.
    block_size: int
    # Blocks never used or fully released (no cached prefix).
    num_free_blocks: int
    # Cached prefix blocks nobody holds; reclaimed LRU.
    num_evictable_blocks: int
    # Requests computing their prompt.
    num_running_prefill: int
    # Requests generating.
    num_running_decode: int
    # Requests queued for (re)prefill.
    num_waiting: int
    # OFFLOADING + OFFLOADED + RESUMING.
    num_offloaded: int
    # Current decode-growth estimate used by admission.
    new_token_ratio: float
    # Preemptions that stashed KV in the cache.
    num_preemptions_offload: int
    # Preemptions that dropped KV at once.
    num_preemptions_recompute: int
    # Offloads that failed and fell back to recompute.
    num_offload_failures: int
    # Restores that failed and fell back to recompute.
    num_restore_failures: int
    # Tokens prefilled again because of recompute preemptions.
    num_recomputed_tokens: int
    # Requests finished in any way, aborted included.
    num_finished: int
    # Snapshot bytes committed by the cache service.
    bytes_offloaded: int
    # Snapshot bytes restored into blocks.
    bytes_restored: int
    # schedule() calls.
    num_steps: int
    # The cache service answered at the latest probe; False when none is
    # configured or it is unreachable (AUTO preemptions then recompute).
    cache_available: bool
    # Prompt tokens of requests whose prefill completed (once per request).
    num_prompt_tokens: int
    # Output tokens generated.
    num_generation_tokens: int
    # Prompt (and recomputed) tokens whose KV a prefix-cache hit supplied.
    num_prefix_hit_tokens: int
    # P/D, decode instance: requests holding reserved blocks now, and
    # ReserveBlocks calls accepted, refused (too few blocks) and expired unused.
    num_reserved: int
    num_reservations_accepted: int
    num_reservations_refused: int
    num_reservations_expired: int
    # P/D, prefill instance: requests handing off or decoding on a decode
    # instance now; handoffs whose snapshot was committed, and their bytes;
    # handoffs that failed (the request came back to be finished here).
    num_handed_off: int
    num_handoffs: int
    bytes_handed_off: int
    num_handoff_failures: int

    @property
    def kv_usage_ratio(self) -> float:
        """Share of the pool held by requests (neither free nor evictable), in [0, 1]."""
        num_free = self.num_free_blocks + self.num_evictable_blocks
        return (self.num_total_blocks - num_free) / self.num_total_blocks
