"""Contracts between the scheduler core and the engine that drives it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvstash.common.stats import counter, gauge
from scheduler_svc.core.config import PreemptionMode
from scheduler_svc.core.request import RequestStatus, RequestUsage
from scheduler_svc.core.seq import ScheduledSeq


@dataclass(slots=True)
class OffloadCommand:
    """Copy a preempted request's blocks into a cache-service snapshot.

    The blocks stay allocated (nobody else may write them) until the engine
    reports back with `Scheduler.finish_offload` (`PdManager.finish_handoff`
    for a P/D hand-off's copy).
    """

    # The preempted request.
    request_id: str
    # Key to store the snapshot under.
    snapshot_id: str
    # Blocks to copy, in order; they hold positions [0, num_tokens).
    block_ids: list[int]
    # Positions of KV to keep.
    num_tokens: int
    # A prefix-tier segment (prefix_tier.py), named by its content: stored
    # unpinned; one already stored counts as saved. Its blocks are held by the
    # save, not the request; the engine reports back with
    # `Scheduler.finish_prefix_save`.
    shared_prefix: bool = False


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
    # Read without consuming: a prefix-tier segment (PrefixLoad).
    keep: bool = False


@dataclass(slots=True)
class PrefixLoad:
    """Copy stored segments into a LOADING request's fresh blocks, in order.

    Answered with `Scheduler.finish_prefix_load(load, n)`: the first n
    segments landed; the request prefills the rest."""

    # The request loading.
    request_id: str
    # Keys this load while in flight (Lifecycle.loads).
    load_id: str
    # The prompt segment segments[0] is.
    first_segment: int
    # One read per segment, in prompt order (RestoreCommand.keep set).
    segments: list[RestoreCommand]
    # Seconds predicted for these reads, and for prefilling their tokens
    # instead (None: not yet measured): why admission chose to load.
    predicted_load_s: float | None = None
    predicted_prefill_s: float | None = None


class PreemptReason(enum.Enum):
    """Why a victim's KV is offloaded or dropped."""

    FORCED = "forced"  # preemption_mode OFFLOAD or RECOMPUTE
    CHEAPER = "cheaper"  # AUTO: predicted cheaper than the other way
    NO_ESTIMATE = "no_estimate"  # AUTO: offloads until both ways are measured
    CACHE_UNAVAILABLE = "cache_unavailable"  # AUTO: recomputes while the cache is down
    # AUTO: offloads one victim in REMEASURE_EVERY that copies were predicted
    # dearer for, so the copy estimates stay measured (preemption.py).
    REMEASURE = "remeasure"


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
    # Predicted seconds of offload + restore, and of recompute (in every mode:
    # the positions after its leading blocks other requests keep cached);
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
    # Prefix tier (prefix_tier.py): admitted requests' segments to load, and
    # prefilled prompts' segments to save.
    prefix_loads: list[PrefixLoad] = field(default_factory=list)
    prefix_saves: list[OffloadCommand] = field(default_factory=list)


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
    """The scheduler's cumulative figures, incremented in place as things happen
    (plain attribute increments: the step loop counts every token). Each field
    is declared once, here, with its metric (kvstash.common.stats); SchedulerStats
    carries them all."""

    num_preemptions_offload: int = counter("preemptions_offload", "Preemptions that stashed KV")
    num_preemptions_recompute: int = counter("preemptions_recompute",
                                             "Preemptions that dropped KV")
    num_offload_failures: int = counter("offload_failures",
                                        "Offloads that failed (fell back to recompute)")
    num_restore_failures: int = counter(
        "restore_failures", "Restores that failed (fell back to recompute; a decode "
        "instance's hand-off: given back to its prefill instance)")
    num_recomputed_tokens: int = counter("recomputed_tokens",
                                         "Tokens prefilled again after preemption")
    # Aborted ones included. Each counter counts what this instance did: a
    # request a prefill instance handed off (P/D) counts as finished on the
    # decode instance if it finished there (else, aborted or taken back, on the
    # prefill instance), and its tokens after the first as generated there.
    num_finished: int = counter("finished_requests",
                                "Requests finished here, any reason (P/D: a handed-off "
                                "request where it was decoded)")
    # Once per request (P/D: on the prefill instance).
    num_prompt_tokens: int = counter("prompt_tokens",
                                     "Prompt tokens of requests whose prefill completed")
    num_generation_tokens: int = counter("generation_tokens", "Output tokens sampled here")
    # At every admission, a recompute's included: the tokens that needed KV
    # (its prompt; prompt and output on a recompute), and those a hit supplied.
    # Their ratio is the hit rate (vLLM's prefix_cache_queries and _hits).
    num_prefix_query_tokens: int = counter(
        "prefix_query_tokens", "Tokens looked up in the prefix cache at admission")
    num_prefix_hit_tokens: int = counter("prefix_hit_tokens",
                                         "Prompt tokens whose KV a prefix-cache hit supplied")
    # Snapshot bytes the cache service committed, and bytes restored into blocks.
    bytes_offloaded: int = counter("offloaded_bytes", "KV bytes stashed in the cache service")
    bytes_restored: int = counter("restored_bytes",
                                  "KV bytes of preempted requests brought back from the cache "
                                  "service")
    # P/D, decode instance: ReserveBlocks calls.
    num_reservations_accepted: int = counter(
        "reservations_accepted", "P/D: block reservations a decode instance accepted")
    num_reservations_refused: int = counter(
        "reservations_refused", "P/D: block reservations refused (too few blocks or seats)")
    num_reservations_expired: int = counter(
        "reservations_expired", "P/D: block reservations released unused after the timeout")
    # P/D, prefill instance: handoffs whose snapshot was committed, their
    # bytes, and those that failed.
    num_handoffs: int = counter(
        "handoffs", "P/D: prefilled requests whose KV was copied out for a decode instance")
    bytes_handed_off: int = counter("handoff_bytes",
                                    "P/D: KV bytes copied out for decode instances")
    num_handoff_failures: int = counter(
        "handoff_failures", "P/D: handoffs that failed: the copy, or no decode instance took "
        "it in time (the request finished on this instance)")
    # P/D, decode instance: hand-offs' bytes restored into reserved blocks
    # (not in bytes_restored; a failed one counts in num_restore_failures).
    bytes_handed_in: int = counter(
        "handoff_restored_bytes", "P/D: KV bytes of prefill instances' hand-offs restored here")
    # Prefix tier (prefix_tier.py).
    num_tier_hit_tokens: int = counter(
        "prefix_tier_hit_tokens", "Prompt tokens whose KV was loaded from the prefix tier")
    bytes_tier_loaded: int = counter("prefix_tier_loaded_bytes",
                                     "KV bytes loaded from the prefix tier")
    num_tier_load_failures: int = counter(
        "prefix_tier_load_failures", "Prefix-tier segment loads that failed (prefilled instead)")
    num_tier_loads_declined: int = counter(
        "prefix_tier_loads_declined",
        "Prefix-tier hits prefilled instead: the load was predicted dearer")
    num_tier_saves: int = counter("prefix_tier_saves",
                                  "Prompt segments saved to the prefix tier")
    bytes_tier_saved: int = counter(
        "prefix_tier_saved_bytes", "KV bytes saved to the prefix tier (0 for a segment "
        "another instance stored first)")
    num_tier_save_failures: int = counter("prefix_tier_save_failures",
                                          "Prompt segment saves that failed")


@dataclass(slots=True, kw_only=True)
class SchedulerStats(Counters):
    """A snapshot: every counter as it stood, plus the figures read from the
    scheduler's state at the time. The service reports it over GetStats
    (kvstash.v1.SchedulerStats, field by field) and exports it as metrics;
    each field is declared once, here or in Counters (kvstash.common.stats)."""

    # schedule() calls: the step id, which the scheduler keeps itself.
    num_steps: int = counter("steps", "Engine steps scheduled")
    num_total_blocks: int = gauge("KV blocks in the pool")
    block_size: int = gauge("Tokens per block", exported=False)
    num_free_blocks: int = gauge("KV blocks never used or fully released")
    num_evictable_blocks: int = gauge("Cached prefix blocks nobody holds (reclaimed LRU)")
    num_running_prefill: int = gauge("Requests computing their prompt")
    num_running_decode: int = gauge("Requests generating")
    num_waiting: int = gauge("Requests queued for (re)prefill")
    # OFFLOADING + OFFLOADED + RESUMING.
    num_offloaded: int = gauge("Requests offloading, offloaded or resuming")
    # The decode-growth estimate admission uses now.
    new_token_ratio: float = gauge(
        "Share of each decode request's remaining tokens reserved at admission")
    # False when no cache is configured, or it did not answer the latest probe.
    cache_available: bool = gauge("1 while the cache service answers; 0: preemptions recompute")
    num_reserved: int = gauge(
        "P/D decode instance: requests holding blocks reserved for their KV")
    num_loading: int = gauge("Requests loading prompt segments from the prefix tier")
    # HANDING_OFF + HANDED_OFF.
    num_handed_off: int = gauge(
        "P/D prefill instance: requests handing off or decoding elsewhere")

    @property
    def kv_usage_ratio(self) -> float:
        """Share of the pool held by requests (neither free nor evictable), in [0, 1]."""
        num_free = self.num_free_blocks + self.num_evictable_blocks
        return (self.num_total_blocks - num_free) / self.num_total_blocks
