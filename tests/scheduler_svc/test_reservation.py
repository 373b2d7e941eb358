from __future__ import annotations

import random

import pytest

from kvstash.common.sampling import SamplingParams
from scheduler_svc.core.config import PreemptionMode, ReservationPolicy
from scheduler_svc.core.outputs import OffloadCommand, RestoreCommand
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.reservation import Reservation
from scheduler_svc.core.scheduler import Scheduler
from tests.scheduler_svc.factories import (
    add,
    finish_offload,
    finish_restore,
    make_config,
    make_scheduler,
    run_to_end,
    step,
)


def make_request(max_tokens: int, num_output: int = 0) -> Request:
    req = Request.create(
        "r", [1], SamplingParams(max_tokens=max_tokens), arrival_time=0.0, arrival_seq=0
    )
    req.output_token_ids.extend([1] * num_output)
    return req


def test_ratio_decays_linearly_to_the_floor() -> None:
    config = make_config(new_token_ratio_decay_steps=10)
    reservation = Reservation(config)
    decay = (0.7 - 0.7 * 0.14) / 10
    reservation.on_step(idle=False)
    assert reservation.new_token_ratio == pytest.approx(0.7 - decay)
    for _ in range(5):
        reservation.on_step(idle=False)
    assert reservation.new_token_ratio == pytest.approx(0.7 - 6 * decay)
    for _ in range(100):
        reservation.on_step(idle=False)
    assert reservation.new_token_ratio == pytest.approx(0.098)


def test_ratio_resets_when_idle() -> None:
    reservation = Reservation(make_config())
    for _ in range(50):
        reservation.on_step(idle=False)
    assert reservation.new_token_ratio < 0.7
    reservation.on_step(idle=True)
    assert reservation.new_token_ratio == 0.7


def test_scheduler_resets_ratio_when_nothing_runs_or_waits() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", max_tokens=3)
    for _ in range(3):
        step(scheduler)
    assert scheduler.stats().new_token_ratio < 0.7
    step(scheduler)  # idle step
    assert scheduler.stats().new_token_ratio == 0.7


def test_ratio_recomputed_after_preemption() -> None:
    reservation = Reservation(make_config(retract_steps=20))
    decoding = [make_request(100, num_output=10), make_request(300, num_output=30)]
    reservation.on_preemption(decoding)
    # (decoded 40 + 20 steps * 2 requests) / (max_tokens 400 + 1)
    assert reservation.new_token_ratio == pytest.approx(80 / 401)


def test_the_scheduler_re_estimates_the_ratio_when_it_preempts() -> None:
    """The ratio decayed to its floor lets admission overcommit; the
    preemption that follows re-estimates it from the decodes that keep
    running (tested above on Reservation alone), or admission goes on
    overcommitting and every few steps another decode is preempted."""
    scheduler = make_scheduler(num_blocks=16, block_size=2, init_new_token_ratio=0.5,
                               new_token_ratio_decay_steps=5, retract_steps=2,
                               preemption_mode=PreemptionMode.RECOMPUTE)
    for i in range(4):
        add(scheduler, f"r{i}", prompt_len=2, max_tokens=20, first_token=10 + 5 * i,
            ignore_eos=True)
    output = scheduler.schedule()
    while not output.preempted:
        scheduler.update(output, {seq.request_id: 1 for seq in output.seqs if seq.sample})
        output = scheduler.schedule()
    assert [p.request_id for p in output.preempted] == ["r3"]
    kept = {rid: len(r.output_token_ids) for rid, r in scheduler.life.decoding.items()}
    assert kept == {"r0": 7, "r1": 7, "r2": 5}
    # (decoded 19 + 2 retract steps * 3 requests) / (max_tokens 60 + 1), not the floor 0.07
    assert scheduler.stats().new_token_ratio == pytest.approx(25 / 61)


def test_recomputed_ratio_is_capped_at_init() -> None:
    reservation = Reservation(make_config(retract_steps=20))
    reservation.on_preemption([make_request(10, num_output=9)])
    assert reservation.new_token_ratio == 0.7


def test_reserved_blocks_clip_remaining_output() -> None:
    reservation = Reservation(make_config(block_size=16))
    clipped, near_end = make_request(100_000), make_request(100, num_output=60)
    assert reservation.reserved_blocks(clipped) == 180  # ceil(4096 * 0.7 / 16)
    assert reservation.reserved_blocks(near_end) == 2  # ceil(40 * 0.7 / 16)
    assert reservation.total_reserved_blocks([clipped, near_end, near_end]) == 184


def test_reserved_blocks_stop_at_what_the_request_can_still_use() -> None:
    reservation = Reservation(make_config(block_size=16))
    # 1 prompt + 100 output tokens: 100 positions need KV, 7 blocks in all.
    req = make_request(100)
    assert reservation.reserved_blocks(req) == 5  # ceil(100 * 0.7 / 16)
    req.block_ids.extend(range(4))
    assert reservation.reserved_blocks(req) == 3
    assert reservation.reserved_blocks(req, num_held=7) == 0
    assert reservation.total_reserved_blocks([req]) == 3


def test_fixed_blocks_policy() -> None:
    config = make_config(reservation_policy=ReservationPolicy.FIXED_BLOCKS,
                         fixed_blocks_per_decode=3)
    reservation = Reservation(config)
    assert reservation.reserved_blocks(make_request(100_000)) == 3
    assert reservation.total_reserved_blocks([make_request(5), make_request(9)]) == 6


@pytest.mark.parametrize(
    ("policy", "admitted"),
    [(ReservationPolicy.NEW_TOKEN_RATIO, False), (ReservationPolicy.FIXED_BLOCKS, True)],
)
def test_admission_keeps_reservation_for_running_decodes(
    policy: ReservationPolicy, admitted: bool
) -> None:
    # 12 blocks of 4. "a" decodes with 40 tokens left: 0.7 * 40 = 28 tokens = 7 blocks.
    scheduler = make_scheduler(num_blocks=12, reservation_policy=policy,
                               fixed_blocks_per_decode=1, new_token_ratio_decay_steps=10**6)
    add(scheduler, "a", prompt_len=4, max_tokens=41, ignore_eos=True)
    step(scheduler)
    add(scheduler, "b", prompt_len=16, max_tokens=4, first_token=50)
    output, _ = step(scheduler)
    # "b" needs 4 blocks; 10 are left after "a"'s two: 10 - 4 < 7 under the ratio policy.
    assert ("b" in [s.request_id for s in output.seqs]) is admitted


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
    finish_offload(scheduler, offload.request_id, 1)
    while not output.restores:
        output, _ = step(scheduler)
    resuming = scheduler.get_request(offload.request_id)
    assert resuming is not None and resuming.status is RequestStatus.RESUMING
    stats = scheduler.stats()
    assert stats.num_free_blocks + stats.num_evictable_blocks == 4
    add(scheduler, "late", prompt_len=12, max_tokens=1)  # 3 of the 4: leaves 1 < 2
    output, _ = step(scheduler)
    assert "late" not in [s.request_id for s in output.seqs]
    finish_restore(scheduler, offload.request_id, 1)
    run_to_end(scheduler)
    assert scheduler.get_request("late") is None  # finished, all the same


@pytest.mark.parametrize("policy", list(ReservationPolicy))
def test_an_admission_keeps_back_its_own_reservation_too(policy: ReservationPolicy) -> None:
    """8 blocks of 4. "d" takes its 4th and last block as "n" comes (16
    prompt tokens: 4 blocks, 8 to generate); "n" would take the other 4 and,
    with none kept for its own decodes, be preempted on its first: it waits
    for "d" instead."""
    scheduler = make_scheduler(num_blocks=8, reservation_policy=policy,
                               fixed_blocks_per_decode=1,
                               preemption_mode=PreemptionMode.RECOMPUTE)
    add(scheduler, "d", prompt_len=4, max_tokens=12, ignore_eos=True)
    for _ in range(9):
        step(scheduler)
    d = scheduler.get_request("d")
    assert d is not None and len(d.block_ids) == 3
    add(scheduler, "n", prompt_len=16, max_tokens=8, first_token=30, ignore_eos=True)
    run_to_end(scheduler)
    stats = scheduler.stats()
    assert stats.num_preemptions_recompute == stats.num_recomputed_tokens == 0


def test_a_request_that_fits_the_pool_alone_is_admitted_under_fixed_blocks() -> None:
    """fixed_blocks reserves N blocks for any decode; one that can use none
    more (prompt + output fill the pool) must not keep them back for itself."""
    scheduler = make_scheduler(num_blocks=4, reservation_policy=ReservationPolicy.FIXED_BLOCKS,
                               fixed_blocks_per_decode=1)
    add(scheduler, "whole", prompt_len=14, max_tokens=2, ignore_eos=True)  # 15 positions: 4 blocks
    add(scheduler, "next", prompt_len=4, max_tokens=2, first_token=40, ignore_eos=True)
    for _ in range(20):
        step(scheduler)
    assert not scheduler.has_unfinished_requests


def _kept_back_as_needed(scheduler: Scheduler) -> int:
    """What the requests about to decode can still use of their reservations."""
    life, own = scheduler.life, scheduler.reservation.own_blocks
    limit = scheduler.config.max_num_batched_tokens
    about_to_decode = [*life.decoding.values(), *life.resuming.values(),
                       *(r for r in life.prefilling.values()
                         if r.num_tokens - r.num_computed_tokens <= limit)]
    return sum(own(r, len(r.block_ids)) for r in about_to_decode)


@pytest.mark.parametrize("policy", list(ReservationPolicy))
def test_a_resume_keeps_back_what_admission_promised(policy: ReservationPolicy) -> None:
    """Random offload workloads on small pools: whenever a step resumes an
    offloaded request, the blocks left still cover the reservations of every
    request about to decode (prefills on their last chunk and requests
    already resuming included, and the resumed one's own). No resume headroom:
    its slack hid a step's second resume forgetting the first one's own."""
    for seed in range(300):
        rng = random.Random(seed)
        scheduler = make_scheduler(
            num_blocks=rng.randint(8, 24), preemption_mode=PreemptionMode.OFFLOAD,
            reservation_policy=policy, fixed_blocks_per_decode=rng.randint(0, 2),
            bytes_per_block=1, max_num_batched_tokens=rng.choice([8, 16, 64]),
            new_token_ratio_decay_steps=rng.choice([5, 50]), resume_headroom=0)
        in_flight: list[OffloadCommand | RestoreCommand] = []
        for n in range(300):
            if rng.random() < 0.3 and n < 90:
                add(scheduler, f"r{n}", prompt_len=rng.randint(1, 12),
                    max_tokens=rng.randint(1, 16), first_token=1 + n % 80, ignore_eos=True)
            output = scheduler.schedule()
            if output.restores:
                left = scheduler.kv.pool.num_allocatable_blocks
                assert left >= _kept_back_as_needed(scheduler), f"seed {seed}, step {n}"
            scheduler.update(output, {seq.request_id: 1 for seq in output.seqs if seq.sample})
            scheduler.check_integrity()
            in_flight += [*output.offloads, *output.restores]
            rng.shuffle(in_flight)
            while in_flight and rng.random() < 0.6:
                copy = in_flight.pop()
                if isinstance(copy, OffloadCommand):
                    scheduler.finish_offload(copy, 1)
                else:
                    scheduler.finish_restore(copy, 1)
