"""Preemption: victims, modes, the offload/restore protocol, aborts mid-copy."""

from __future__ import annotations

import math
import random

import pytest

from kvstash.common.sampling import SamplingParams
from scheduler_svc.core.config import PreemptionMode, ReservationPolicy
from scheduler_svc.core.outputs import Preempted, PreemptReason
from scheduler_svc.core.preemption import REMEASURE_EVERY
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from tests.scheduler_svc.factories import (
    add,
    finish_offload,
    finish_restore,
    ids,
    make_scheduler,
    run_to_end,
    step,
    teach_costs,
)

S = RequestStatus


def tight_scheduler(num_blocks: int, mode: PreemptionMode, **overrides: object) -> Scheduler:
    """block_size 2, nothing reserved: preemption comes early."""
    values: dict[str, object] = {
        "num_blocks": num_blocks, "block_size": 2, "preemption_mode": mode,
        "reservation_policy": ReservationPolicy.FIXED_BLOCKS, "fixed_blocks_per_decode": 0,
        "bytes_per_block": 100,
    }
    values.update(overrides)
    return make_scheduler(**values)


def status(scheduler: Scheduler, request_id: str) -> RequestStatus:
    req = scheduler.get_request(request_id)
    assert req is not None
    return req.status


def two_decodes_then_pressure(mode: PreemptionMode) -> tuple[Scheduler, object]:
    """'a' (prompt 2) and 'b' (prompt 4) decode in a 4-block pool; step 2 runs short."""
    scheduler = tight_scheduler(4, mode)
    add(scheduler, "a", prompt_len=2, max_tokens=6, ignore_eos=True)
    add(scheduler, "b", prompt_len=4, max_tokens=4, ignore_eos=True, first_token=40)
    step(scheduler, token_id=5)
    output, _ = step(scheduler, token_id=6)
    return scheduler, output


def test_victim_is_shortest_output_then_longest_prompt() -> None:
    scheduler, output = two_decodes_then_pressure(PreemptionMode.RECOMPUTE)
    # Equal outputs: "b" has the longer prompt.
    assert status(scheduler, "b") is S.WAITING and ids(output.seqs) == ["a"]
    scheduler = tight_scheduler(6, PreemptionMode.RECOMPUTE)
    add(scheduler, "a", prompt_len=2, max_tokens=8, ignore_eos=True)
    add(scheduler, "b", prompt_len=4, max_tokens=8, ignore_eos=True, first_token=40)
    step(scheduler)
    add(scheduler, "c", prompt_len=2, max_tokens=8, ignore_eos=True, first_token=60)
    step(scheduler)
    output, _ = step(scheduler)
    # "c" has the shortest output although "b" has the longest prompt.
    assert status(scheduler, "c") is S.WAITING
    assert ids(output.seqs) == ["a", "b"]
    assert scheduler.stats().num_preemptions_recompute == 1


def test_recompute_keeps_output_and_counts_recomputed_tokens() -> None:
    scheduler, _ = two_decodes_then_pressure(PreemptionMode.RECOMPUTE)
    b = scheduler.get_request("b")
    assert b is not None
    assert b.output_token_ids == [5] and b.block_ids == [] and b.num_preemptions == 1
    while b.status is not S.RUNNING_DECODE:
        output, _ = step(scheduler, token_id=7)
    [b_seq] = [s for s in output.seqs if s.request_id == "b"]
    # Prefilled prompt + output again in one chunk, minus cached blocks that survived;
    # 4 positions had KV before: re-prefilling below 4 is recomputation.
    assert b_seq.token_ids[-1] == 5 and b_seq.start_pos + len(b_seq.token_ids) == 5
    assert b.num_recomputed_tokens == 4 - b_seq.start_pos
    assert scheduler.stats().num_recomputed_tokens == b.num_recomputed_tokens
    assert b.output_token_ids == [5, 7]


def test_prefill_is_never_preempted_and_one_decode_keeps_running() -> None:
    scheduler = tight_scheduler(6, PreemptionMode.RECOMPUTE, max_num_batched_tokens=3,
                                max_num_seqs=2)
    add(scheduler, "a", prompt_len=2, max_tokens=10, ignore_eos=True)
    step(scheduler)
    add(scheduler, "long", prompt_len=8, max_tokens=2, first_token=50)  # 4 blocks, 4 chunks
    skipped = False
    for _ in range(4):
        output, _ = step(scheduler)
        skipped |= "a" not in ids(output.seqs)
        assert status(scheduler, "a") is S.RUNNING_DECODE
    assert status(scheduler, "long") is S.RUNNING_DECODE
    # "a" ran out of blocks while "long" prefilled: it waited, nobody was preempted.
    assert skipped and scheduler.stats().num_preemptions_recompute == 0


def first_snapshot_of_b(scheduler: Scheduler) -> str:
    """Snapshot ids carry the scheduler's random prefix, so no two collide."""
    return f"{scheduler.config.snapshot_id_prefix}.b.0"


def test_offload_holds_blocks_until_the_copy_lands_then_resumes() -> None:
    scheduler, output = two_decodes_then_pressure(PreemptionMode.OFFLOAD)
    [offload] = output.offloads
    b = scheduler.get_request("b")
    assert b is not None and b.status is S.OFFLOADING
    assert (offload.request_id, offload.block_ids, offload.num_tokens) == ("b", [1, 2], 4)
    snapshot_id = first_snapshot_of_b(scheduler)
    assert offload.snapshot_id == b.snapshot_id == snapshot_id
    assert scheduler.kv.pool.ref_cnt(1) == 1  # still allocated: a copy is in flight
    step(scheduler)
    assert scheduler.stats().num_offloaded == 1
    finish_offload(scheduler, "b", 4096)
    assert b.status is S.OFFLOADED and b.block_ids == [] and b.bytes_offloaded == 4096
    while b.status is S.OFFLOADED:
        output, _ = step(scheduler, token_id=8)
    [restore] = output.restores
    assert (restore.request_id, len(restore.block_ids)) == ("b", 2)
    assert restore.snapshot_id == snapshot_id
    assert b.status is S.RESUMING and b.block_ids == restore.block_ids
    output, _ = step(scheduler)
    assert "b" not in ids(output.seqs)  # not scheduled before the restore is acknowledged
    finish_restore(scheduler, "b", 4096)
    assert scheduler.take_snapshots_to_delete() == []  # the restore consumed it
    output, _ = step(scheduler, token_id=9)
    [b_seq] = [s for s in output.seqs if s.request_id == "b"]
    # Continues from the next token: KV of positions 0..3 came back, no recompute.
    assert (b_seq.token_ids, b_seq.start_pos) == ([5], 4)
    assert b.num_recomputed_tokens == 0 and b.output_token_ids == [5, 9]
    stats = scheduler.stats()
    assert stats.num_preemptions_offload == 1 and stats.bytes_restored == 4096


def test_offload_failure_falls_back_to_recompute() -> None:
    scheduler, _ = two_decodes_then_pressure(PreemptionMode.OFFLOAD)
    finish_offload(scheduler, "b", None)
    b = scheduler.get_request("b")
    assert b is not None and b.status is S.WAITING and b.snapshot_id is None
    assert scheduler.take_snapshots_to_delete() == []  # a failed put stores nothing
    assert scheduler.stats().num_offload_failures == 1


def test_restore_failure_frees_blocks_and_recomputes() -> None:
    scheduler, _ = two_decodes_then_pressure(PreemptionMode.OFFLOAD)
    finish_offload(scheduler, "b", 10)
    b = scheduler.get_request("b")
    assert b is not None
    while b.status is not S.RESUMING:
        step(scheduler)
    finish_restore(scheduler, "b", None)
    assert b.status is S.WAITING and b.block_ids == []
    assert scheduler.take_snapshots_to_delete() == [first_snapshot_of_b(scheduler)]
    scheduler.check_integrity()


@pytest.mark.parametrize(("available", "expected"), [(False, S.WAITING), (True, S.OFFLOADING)])
def test_auto_offloads_only_while_the_cache_answers(available: bool, expected: S) -> None:
    scheduler = tight_scheduler(4, PreemptionMode.AUTO)
    scheduler.set_cache_available(available)
    add(scheduler, "a", prompt_len=2, max_tokens=6, ignore_eos=True)
    add(scheduler, "b", prompt_len=4, max_tokens=4, ignore_eos=True, first_token=40)
    step(scheduler)
    step(scheduler)
    assert status(scheduler, "b") is expected


def test_auto_put_refused_by_the_cache_falls_back_to_recompute() -> None:
    """No shadow account of the cache's bytes: its refusal is the capacity answer."""
    scheduler = tight_scheduler(4, PreemptionMode.AUTO)
    scheduler.set_cache_available(True)
    add(scheduler, "a", prompt_len=2, max_tokens=6, ignore_eos=True)
    add(scheduler, "b", prompt_len=4, max_tokens=4, ignore_eos=True, first_token=40)
    step(scheduler)
    step(scheduler)
    finish_offload(scheduler, "b", None)  # RESOURCE_EXHAUSTED
    assert status(scheduler, "b") is S.WAITING
    stats = scheduler.stats()
    assert (stats.num_preemptions_offload, stats.num_offload_failures) == (1, 1)
    assert scheduler.take_snapshots_to_delete() == []
    scheduler.set_cache_available(False)  # later preemptions recompute: nobody lands copies
    run_to_end(scheduler)
    assert scheduler.stats().num_recomputed_tokens > 0


@pytest.mark.parametrize("aborted", [False, True], ids=["offloading", "aborted"])
def test_blocks_being_offloaded_count_as_soon_free(aborted: bool) -> None:
    """Aborted, a victim leaves OFFLOADING, but its copy still frees its
    blocks when it lands: before, a second decode was preempted for them."""
    scheduler = tight_scheduler(6, PreemptionMode.OFFLOAD)
    for i, name in enumerate("abc"):
        add(scheduler, name, prompt_len=2, max_tokens=8, ignore_eos=True, first_token=10 + 9 * i)
    for _ in range(3):
        step(scheduler)
    output, _ = step(scheduler)
    assert ids(output.offloads) == ["a"] and ids(output.seqs) == []
    if aborted:
        scheduler.abort("a")
    output, _ = step(scheduler)  # still in flight: wait for it, preempt nobody else
    assert output.offloads == [] and output.preempted == []
    assert status(scheduler, "b") is S.RUNNING_DECODE
    finish_offload(scheduler, "a", 1)
    output, _ = step(scheduler)
    assert ids(output.seqs) == ["b", "c"]
    scheduler.check_integrity()


def test_offloaded_requests_resume_before_new_arrivals_in_order() -> None:
    """"a" waits OFFLOADED for its 2 blocks plus 2 of headroom per decode
    while "new" (1 block) would fit: it is not admitted in between."""
    scheduler = tight_scheduler(6, PreemptionMode.OFFLOAD, resume_headroom=2)
    for i, name in enumerate("abc"):
        add(scheduler, name, prompt_len=2, max_tokens=8, ignore_eos=True, first_token=10 + 9 * i)
    for _ in range(3):
        step(scheduler)
    step(scheduler)
    finish_offload(scheduler, "a", 1)
    add(scheduler, "new", prompt_len=2, max_tokens=2, first_token=80)
    resumed = []
    num_steps_new_would_fit = 0
    while status(scheduler, "a") is S.OFFLOADED:
        num_steps_new_would_fit += scheduler.kv.pool.num_allocatable_blocks >= 1
        output, _ = step(scheduler)
        assert "new" not in ids(output.seqs)
        resumed += ids(output.restores)
        for offload in output.offloads:
            finish_offload(scheduler, offload.request_id, 1)
    assert resumed == ["a"] and num_steps_new_would_fit >= 2


def test_nothing_new_is_admitted_while_a_victim_is_still_being_offloaded() -> None:
    """Free blocks while "b"'s copy is in flight ("a" aborted) go to no new
    arrival: "b" takes its blocks back first, once its snapshot landed."""
    scheduler, _ = two_decodes_then_pressure(PreemptionMode.OFFLOAD)
    assert status(scheduler, "b") is S.OFFLOADING
    scheduler.abort("a")
    add(scheduler, "new", prompt_len=2, max_tokens=2, ignore_eos=True, first_token=80)
    for _ in range(3):
        assert scheduler.kv.pool.num_allocatable_blocks >= 1  # "new" would fit
        output, _ = step(scheduler)
        assert "new" not in ids(output.seqs) and status(scheduler, "b") is S.OFFLOADING
    finish_offload(scheduler, "b", 1)
    output, _ = step(scheduler)  # "b" takes its blocks first; "new" may have the rest
    assert ids(output.restores) == ["b"]


@pytest.mark.parametrize("state", [S.OFFLOADING, S.OFFLOADED, S.RESUMING])
@pytest.mark.parametrize("copy_ok", [True, False])
def test_abort_while_preempted_releases_blocks_and_snapshot(state: S, copy_ok: bool) -> None:
    scheduler, _ = two_decodes_then_pressure(PreemptionMode.OFFLOAD)
    if state is not S.OFFLOADING:
        finish_offload(scheduler, "b", 10)
    if state is S.RESUMING:
        while status(scheduler, "b") is not S.RESUMING:
            step(scheduler)
    b = scheduler.get_request("b")
    assert b is not None
    held = list(b.block_ids)
    scheduler.abort("b")
    scheduler.check_integrity()
    assert scheduler.get_request("b") is None  # it leaves at once; its copy lands later
    if state is S.OFFLOADED:
        assert scheduler.take_snapshots_to_delete() == [first_snapshot_of_b(scheduler)]
        return
    # A copy is in flight: its blocks stay allocated until it lands.
    assert all(scheduler.kv.pool.ref_cnt(block) == 1 for block in held)
    assert scheduler.stats().num_offloaded == 0
    step(scheduler)
    if state is S.OFFLOADING:
        finish_offload(scheduler, "b", 10 if copy_ok else None)
    else:
        finish_restore(scheduler, "b", 10 if copy_ok else None)
    assert all(scheduler.kv.pool.ref_cnt(block) == 0 for block in held)
    # A committed put is deleted; a successful restore consumed the snapshot;
    # a failed restore may have left it.
    expect_delete = copy_ok if state is S.OFFLOADING else not copy_ok
    expected = [first_snapshot_of_b(scheduler)] if expect_delete else []
    assert scheduler.take_snapshots_to_delete() == expected
    scheduler.check_integrity()
    while scheduler.has_unfinished_requests:
        step(scheduler)
    stats = scheduler.stats()
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_total_blocks
    assert scheduler.is_idle


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
    waiting = [r.request_id for r in scheduler.life.waiting]
    assert waiting == sorted(waiting)


@pytest.mark.parametrize("seed", range(12))
def test_a_decode_waits_at_most_one_step_for_a_finishing_decodes_blocks(seed: int) -> None:
    """Too few blocks, no victim: the blocks of a decode sampling its last
    token count as free after the step, and a decode left without one waits
    that one step. The freed blocks went to the decodes ahead of it in the
    queue that filled theirs since: it waited 4 steps in a row (seed 9)
    while the others decoded."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 3, 4])
    requests = [(rng.randint(1, 3 * block_size), rng.randint(2, 30))
                for _ in range(rng.randint(4, 24))]
    num_needed = sum(-(-(p + m) // block_size) for p, m in requests)
    scheduler = make_scheduler(
        block_size=block_size, preemption_mode=PreemptionMode.RECOMPUTE,
        num_blocks=max(max(-(-(p + m) // block_size) for p, m in requests) + 1,
                       int(num_needed * rng.uniform(0.3, 0.9))),
        reservation_policy=ReservationPolicy.FIXED_BLOCKS, fixed_blocks_per_decode=0,
        max_num_seqs=32, max_num_batched_tokens=256)
    for i, (prompt_len, max_tokens) in enumerate(requests):
        add(scheduler, f"r{i}", prompt_len=prompt_len, max_tokens=max_tokens, ignore_eos=True)
    waited: dict[str, int] = {}  # request id: steps in a row it decoded no token
    for i in range(400):
        if rng.random() < 0.2:  # short ones keep arriving
            add(scheduler, f"x{i}", prompt_len=rng.randint(1, 3 * block_size),
                max_tokens=rng.randint(1, 6), ignore_eos=True)
        decoding = list(scheduler.life.decoding)
        output, _ = step(scheduler)
        served = set(ids(output.seqs)) | set(ids(output.preempted))
        for request_id in decoding:
            waited[request_id] = 0 if request_id in served else waited.get(request_id, 0) + 1
            assert waited[request_id] <= 1, (request_id, i)
        if not scheduler.has_unfinished_requests:
            break
    assert not scheduler.has_unfinished_requests


# ------------------------------------------------------- AUTO weighs the costs

# Rates taught to the cost model (teach_costs): with 11 blocks copied, offload
# + restore takes 0.02 + 0.011 + 0.0167225 + 0.011 = 0.0587225 s, and
# recompute 1e-3 * L + 1e-5 * L^2 s: equal at L = 41.5, inside the 11th block.
OFFLOAD_RATES = (0.02, 1e-3)
RESTORE_RATES = (0.0167225, 1e-3)
PREFILL_RATES = (1e-3, 1e-5)


def preempt_one(num_tokens: int, mode: PreemptionMode, *, taught: bool = True,
                cache_available: bool = True, **rates: tuple[float, float]) -> Scheduler:
    """Request "v" (prompt num_tokens) is preempted at step 2 (block_size 4):
    "a" (prompt 4) needs its second block and the pool has none left."""
    scheduler = make_scheduler(
        num_blocks=-(-num_tokens // 4) + 1, preemption_mode=mode,
        reservation_policy=ReservationPolicy.FIXED_BLOCKS, fixed_blocks_per_decode=0)
    scheduler.set_cache_available(cache_available)
    if taught:
        teach_costs(scheduler.preemption.costs, rates.get("offload", OFFLOAD_RATES),
                    rates.get("restore", RESTORE_RATES), rates.get("prefill", PREFILL_RATES))
    add(scheduler, "a", prompt_len=4, max_tokens=2, ignore_eos=True)
    add(scheduler, "v", prompt_len=num_tokens, max_tokens=3, ignore_eos=True, first_token=50)
    step(scheduler)
    return scheduler


def only_victim(scheduler: Scheduler) -> Preempted:
    output, _ = step(scheduler)
    [choice] = output.preempted
    assert choice.request_id == "v" and ids(output.offloads) == (
        ["v"] if choice.mode is PreemptionMode.OFFLOAD else [])
    expected = S.OFFLOADING if choice.mode is PreemptionMode.OFFLOAD else S.WAITING
    assert status(scheduler, "v") is expected
    return choice


def test_auto_flips_at_the_predicted_crossover() -> None:
    fixed = OFFLOAD_RATES[0] + RESTORE_RATES[0]
    copy_s = fixed + 11 * (OFFLOAD_RATES[1] + RESTORE_RATES[1])
    a, b = PREFILL_RATES
    crossover = (-a + math.sqrt(a * a + 4 * b * copy_s)) / (2 * b)  # a L + b L^2 = copy_s
    below, above = math.floor(crossover), math.ceil(crossover)
    assert (below, above) == (41, 42)  # both 11 blocks: the copy costs the same
    for num_tokens, mode in ((below, PreemptionMode.RECOMPUTE), (above, PreemptionMode.OFFLOAD)):
        choice = only_victim(preempt_one(num_tokens, PreemptionMode.AUTO))
        assert (choice.mode, choice.reason) == (mode, PreemptReason.CHEAPER), num_tokens
        assert (choice.num_tokens, choice.num_blocks) == (num_tokens, 11)
        assert choice.offload_restore_s == pytest.approx(copy_s, rel=1e-6)
        assert choice.recompute_s == pytest.approx(a * num_tokens + b * num_tokens**2, rel=1e-6)


@pytest.mark.parametrize(("mode", "cheap"), [
    (PreemptionMode.OFFLOAD, {"offload": (10.0, 0.0)}),  # recompute predicted far cheaper
    (PreemptionMode.RECOMPUTE, {"prefill": (1.0, 0.0)}),  # offload predicted far cheaper
])
def test_forced_modes_ignore_the_estimate(
    mode: PreemptionMode, cheap: dict[str, tuple[float, float]]
) -> None:
    choice = only_victim(preempt_one(41, mode, **cheap))
    assert (choice.mode, choice.reason) == (mode, PreemptReason.FORCED)
    assert choice.offload_restore_s is not None and choice.recompute_s is not None
    # The same rates make AUTO choose the other way.
    other = only_victim(preempt_one(41, PreemptionMode.AUTO, **cheap))
    assert other.mode is not mode and other.reason is PreemptReason.CHEAPER


def test_auto_recomputes_while_the_cache_is_down_however_cheap_offload_is() -> None:
    choice = only_victim(preempt_one(42, PreemptionMode.AUTO, cache_available=False))
    assert (choice.mode, choice.reason) == (PreemptionMode.RECOMPUTE,
                                            PreemptReason.CACHE_UNAVAILABLE)
    assert choice.offload_restore_s is not None
    assert choice.offload_restore_s < choice.recompute_s  # type: ignore[operator]


def test_auto_measures_copies_again_however_dear_they_were_measured() -> None:
    """Copies teach their estimate only when one runs: measured slow once
    (the first copies of a process allocate pinned buffers), AUTO would
    recompute for good. One victim in REMEASURE_EVERY is offloaded instead."""
    scheduler = preempt_one(41, PreemptionMode.AUTO, offload=(10.0, 0.0))
    preemption = scheduler.preemption
    choices = [preemption.choose(f"v{i}", 41) for i in range(2 * REMEASURE_EVERY + 1)]
    remeasured = [i for i, c in enumerate(choices) if c.reason is PreemptReason.REMEASURE]
    assert remeasured == [REMEASURE_EVERY - 1, 2 * REMEASURE_EVERY - 1]
    assert all(choices[i].mode is PreemptionMode.OFFLOAD for i in remeasured)
    assert all((c.mode, c.reason) == (PreemptionMode.RECOMPUTE, PreemptReason.CHEAPER)
               for i, c in enumerate(choices) if i not in remeasured)
    cheap = preempt_one(41, PreemptionMode.AUTO, prefill=(1.0, 0.0)).preemption
    assert {cheap.choose(f"v{i}", 41).reason for i in range(2 * REMEASURE_EVERY)} == {
        PreemptReason.CHEAPER}  # offloading anyway: nothing to remeasure


def test_auto_offloads_until_both_ways_are_measured() -> None:
    # 41 tokens: recompute would be chosen had the rates been measured.
    choice = only_victim(preempt_one(41, PreemptionMode.AUTO, taught=False))
    assert (choice.mode, choice.reason) == (PreemptionMode.OFFLOAD, PreemptReason.NO_ESTIMATE)
    assert choice.offload_restore_s is None and choice.recompute_s is None


def test_copies_teach_the_cost_model_only_when_they_succeed() -> None:
    scheduler, output = two_decodes_then_pressure(PreemptionMode.OFFLOAD)
    costs = scheduler.preemption.costs
    [offload] = output.offloads
    scheduler.finish_offload(offload, 4096, seconds=0.5)
    assert costs.num_offloads == 1
    b = scheduler.get_request("b")
    assert b is not None
    while b.status is not S.RESUMING:
        output, _ = step(scheduler)
    [restore] = output.restores
    scheduler.finish_restore(restore, None, seconds=0.1)  # failed: nothing learned
    assert costs.num_restores == 0
    scheduler, output = two_decodes_then_pressure(PreemptionMode.OFFLOAD)
    scheduler.finish_offload(output.offloads[0], None, seconds=0.5)
    assert scheduler.preemption.costs.num_offloads == 0


def test_auto_counts_the_prefix_other_requests_keep_as_not_recomputed() -> None:
    """A victim sharing a cached prefix with a request that keeps running
    gets those blocks back at readmission: recomputing it prefills only the
    rest. Predicted as the whole context, AUTO offloaded it (every block,
    the shared ones too) where recomputing its tail was far cheaper."""
    scheduler = make_scheduler(
        num_blocks=12, preemption_mode=PreemptionMode.AUTO,
        reservation_policy=ReservationPolicy.FIXED_BLOCKS, fixed_blocks_per_decode=0)
    scheduler.set_cache_available(True)
    teach_costs(scheduler.preemption.costs, OFFLOAD_RATES, RESTORE_RATES, PREFILL_RATES)
    shared = list(range(50, 90))  # 10 blocks
    scheduler.add_request("a", shared, SamplingParams(8, ignore_eos=True))
    step(scheduler)
    scheduler.add_request("v", [*shared, 1, 2], SamplingParams(6, ignore_eos=True))
    output, _ = step(scheduler)
    v = scheduler.get_request("v")
    assert v is not None and v.num_cached_tokens == 40
    while not output.preempted:
        output, _ = step(scheduler)
    [choice] = output.preempted
    # 44 positions in 11 blocks: the whole context costs more than the copies.
    a, b = PREFILL_RATES
    assert (choice.request_id, choice.num_tokens, choice.num_blocks) == ("v", 44, 11)
    assert a * 44 + b * 44**2 > choice.offload_restore_s  # type: ignore[operator]
    assert choice.recompute_s == pytest.approx(a * 4 + b * (44**2 - 40**2), rel=1e-6)
    assert (choice.mode, choice.reason) == (PreemptionMode.RECOMPUTE, PreemptReason.CHEAPER)
    while v.status is not S.RUNNING_DECODE:
        step(scheduler)
    assert v.num_recomputed_tokens == 4  # as predicted: the 40 shared positions were hits


def test_auto_counts_no_prefix_only_another_victim_of_the_round_holds() -> None:
    """"v1" and "v2" share a 10-block prefix that the survivor "s" does not
    hold, and both are preempted in one round. "v2" (the shorter output)
    went first and counted the prefix as kept because "v1" still held it:
    recomputing 2 positions looked far cheaper than the copies, so AUTO
    recomputed it, though the prefix went too (offloaded with "v1", then
    evictable) and recomputing it all costs more than the copies."""
    scheduler = make_scheduler(
        num_blocks=14, preemption_mode=PreemptionMode.AUTO,
        reservation_policy=ReservationPolicy.FIXED_BLOCKS, fixed_blocks_per_decode=0)
    scheduler.set_cache_available(True)
    teach_costs(scheduler.preemption.costs, OFFLOAD_RATES, RESTORE_RATES, PREFILL_RATES)
    shared = list(range(50, 90))  # 10 blocks
    scheduler.add_request("s", [5, 6, 7, 8], SamplingParams(30, ignore_eos=True))
    step(scheduler)
    step(scheduler)
    scheduler.add_request("v1", [*shared, 1, 2], SamplingParams(8, ignore_eos=True))
    step(scheduler)
    scheduler.add_request("v2", [*shared, 3], SamplingParams(8, ignore_eos=True))
    output, _ = step(scheduler)
    v2 = scheduler.get_request("v2")
    assert v2 is not None and v2.num_cached_tokens == 40
    while not output.preempted:
        output, _ = step(scheduler)
    assert ids(output.preempted) == ["v2", "v1"]  # one round
    a, b = PREFILL_RATES
    for choice in output.preempted:
        num_tokens = choice.num_tokens
        assert choice.recompute_s == pytest.approx(a * num_tokens + b * num_tokens**2, rel=1e-6)
        assert choice.recompute_s > choice.offload_restore_s  # type: ignore[operator]
        assert (choice.mode, choice.reason) == (PreemptionMode.OFFLOAD, PreemptReason.CHEAPER)
    assert [c.num_tokens for c in output.preempted] == [42, 44]


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.OFFLOAD])
def test_a_decode_sampling_its_last_token_is_no_victim(mode: PreemptionMode) -> None:
    """"b" samples its last token (max_tokens) this step in the blocks it
    holds, and frees them after: "a" waits that step for a block. It was
    the victim (the longer prompt), its whole context redone for one token."""
    scheduler = tight_scheduler(3, mode)
    add(scheduler, "a", prompt_len=2, max_tokens=4, ignore_eos=True)
    add(scheduler, "b", prompt_len=3, max_tokens=2, ignore_eos=True, first_token=40)
    step(scheduler)
    output, updates = step(scheduler)
    assert output.preempted == [] and ids(output.seqs) == ["b"]
    [update] = updates
    assert update.finish_status is S.FINISHED_LENGTH and update.usage is not None
    assert update.usage.num_preemptions == 0
    output, _ = step(scheduler)
    assert ids(output.seqs) == ["a"]
    run_to_end(scheduler)
    assert scheduler.stats().num_preemptions_recompute == 0
