"""Behaviour pinned down after review: worker restarts, resume headroom,
victim order and snapshot ids."""

from __future__ import annotations

import pytest

from scheduler_svc.config import PreemptionMode, ReservationPolicy
from scheduler_svc.request import RequestStatus
from tests.scheduler_svc.factories import add, make_config, make_scheduler, step


def run_to_end(scheduler: object) -> None:
    while scheduler.has_unfinished_requests:  # type: ignore[attr-defined]
        step(scheduler)  # type: ignore[arg-type]


def test_reset_prefix_cache_stops_prefix_hits() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_len=12, max_tokens=2)
    run_to_end(scheduler)
    assert scheduler.stats().num_evictable_blocks > 0
    assert scheduler.reset_prefix_cache() > 0
    stats = scheduler.stats()
    assert (stats.num_free_blocks, stats.num_evictable_blocks) == (stats.num_total_blocks, 0)
    add(scheduler, "b", prompt_len=12, max_tokens=2)  # the same prompt as "a"
    output, _ = step(scheduler)
    [seq] = output.seqs
    assert seq.start_pos == 0 and len(seq.token_ids) == 12  # prefilled from scratch


def test_admission_reserves_for_resuming_requests() -> None:
    # "a" is offloaded, "b" finishes, "a" resumes. While "a" is RESUMING its
    # decode reservation (2 blocks) must keep a new arrival from taking the
    # room it is about to grow into.
    scheduler = make_scheduler(num_blocks=8, preemption_mode=PreemptionMode.OFFLOAD,
                               reservation_policy=ReservationPolicy.FIXED_BLOCKS,
                               fixed_blocks_per_decode=2, bytes_per_block=1)
    add(scheduler, "a", prompt_len=8, max_tokens=20)
    add(scheduler, "b", prompt_len=4, max_tokens=20)
    output, _ = step(scheduler)
    while not output.offloads:
        output, _ = step(scheduler)
    [offload] = output.offloads
    scheduler.finish_offload(offload.request_id, 1)
    while not output.restores:
        output, _ = step(scheduler)
    resuming = scheduler.get_request(offload.request_id)
    assert resuming is not None and resuming.status is RequestStatus.RESUMING
    stats = scheduler.stats()
    assert stats.num_free_blocks + stats.num_evictable_blocks == 4
    add(scheduler, "late", prompt_len=12, max_tokens=1)  # 3 of the 4: leaves 1 < 2
    output, _ = step(scheduler)
    assert "late" not in [s.request_id for s in output.seqs]
    scheduler.finish_restore(offload.request_id, ok=True)
    run_to_end(scheduler)
    assert scheduler.get_request("late") is None  # finished, all the same


def test_recompute_victims_keep_arrival_order_at_the_front() -> None:
    scheduler = make_scheduler(num_blocks=8, preemption_mode=PreemptionMode.RECOMPUTE,
                               reservation_policy=ReservationPolicy.FIXED_BLOCKS,
                               fixed_blocks_per_decode=0)
    # Earlier arrivals have longer prompts, so they are preempted first (and
    # each at its own step, as it fills its block): requeued at the front in
    # arrival order, whatever order they were preempted in.
    for i in range(4):
        add(scheduler, f"r{i}", prompt_len=7 - i, max_tokens=20)
    while scheduler.stats().num_preemptions_recompute < 2:
        step(scheduler)
    waiting = [r.request_id for r in scheduler._waiting]
    assert waiting == sorted(waiting)


def test_snapshot_ids_are_unique_per_scheduler() -> None:
    assert make_config().snapshot_id_prefix != make_config().snapshot_id_prefix
    with pytest.raises(ValueError, match="snapshot_id_prefix"):
        make_config(snapshot_id_prefix="../x")
