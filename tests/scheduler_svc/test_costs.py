"""The preemption cost model: fits of copy and prefill rates to measurements."""

from __future__ import annotations

import math
import random
from dataclasses import fields

import pytest

from kvstash.common.sampling import SamplingParams
from scheduler_svc.core.costs import CostModel
from scheduler_svc.core.seq import ScheduledSeq
from scheduler_svc.core.step_fit import nnls, normal_equations
from tests.scheduler_svc.factories import add, make_scheduler, prefill_step, step, teach_costs

# A step's true cost: c + d * decodes + e * sum(decode positions) + a * T + b * sum(e^2 - s^2).
C, D, E, A, B = 2e-3, 5e-5, 1e-8, 2e-4, 3e-8


def random_step(rng: random.Random) -> tuple[list[ScheduledSeq], int, float]:
    """Decodes at long contexts and prefill chunks anywhere: seqs, decodes, seconds."""
    sampling = SamplingParams(1)
    num_decodes = rng.randint(0, 64)
    seqs = [ScheduledSeq(f"d{i}", [1], rng.randint(0, 4000), [], True, sampling)
            for i in range(num_decodes)]
    seconds = C + D * num_decodes + E * sum(s.start_pos for s in seqs)
    for i in range(rng.randint(0, 3)):
        start, length = rng.randint(0, 3000), rng.randint(1, 512)
        seqs.append(ScheduledSeq(f"p{i}", [1] * length, start, [], False, sampling))
        end = start + length
        seconds += A * length + B * (end * end - start * start)
    return seqs, num_decodes, seconds * (1 + rng.gauss(0, 0.02))  # 2% timing noise


def test_step_fit_recovers_the_prefill_rates_from_noisy_mixed_steps() -> None:
    rng = random.Random(0)
    costs = CostModel(block_size=16, min_samples=4)
    for _ in range(400):
        costs.observe_step(*random_step(rng))
    assert costs.step.theta == pytest.approx([C, D, E, A, B], rel=0.1)
    estimates = costs.estimates()
    assert estimates.prefill_s_per_token == pytest.approx(A, rel=0.03)
    assert estimates.prefill_s_per_token_squared == pytest.approx(B, rel=0.03)
    # Recomputing adds no step and no decode: only a * L + b * L^2.
    for num_tokens in (100, 1000, 8000):
        expected = A * num_tokens + B * num_tokens**2
        assert costs.recompute_s(num_tokens) == pytest.approx(expected, rel=0.03)


def test_copy_fits_recover_fixed_and_per_block_seconds() -> None:
    costs = CostModel(block_size=16, min_samples=4)
    rng = random.Random(1)
    for _ in range(60):
        num_blocks = rng.randint(1, 256)
        costs.observe_offload(num_blocks, (0.004 + 1e-4 * num_blocks) * (1 + rng.gauss(0, 0.02)))
        costs.observe_restore(num_blocks, (0.002 + 3e-4 * num_blocks) * (1 + rng.gauss(0, 0.02)))
    e = costs.estimates()
    assert (e.offload_s_fixed, e.offload_s_per_block) == (
        pytest.approx(0.004, rel=0.1), pytest.approx(1e-4, rel=0.03))
    assert (e.restore_s_fixed, e.restore_s_per_block) == (
        pytest.approx(0.002, rel=0.1), pytest.approx(3e-4, rel=0.03))
    assert costs.offload_restore_s(100) == pytest.approx(0.006 + 4e-4 * 100, rel=0.03)


def test_copy_fit_follows_a_rate_that_changed() -> None:
    """Old copies are forgotten: after a slowdown, predictions follow the new rate."""
    costs = CostModel(block_size=16, min_samples=4)
    for num_blocks in [1, 5, 9] * 40:
        costs.observe_offload(num_blocks, 0.001 * num_blocks)
        costs.observe_restore(num_blocks, 0.001 * num_blocks)
    assert costs.offload_restore_s(10) == pytest.approx(0.02, rel=1e-6)
    for num_blocks in [1, 5, 9] * 80:  # three times slower now
        costs.observe_offload(num_blocks, 0.003 * num_blocks)
        costs.observe_restore(num_blocks, 0.003 * num_blocks)
    assert costs.offload_restore_s(10) == pytest.approx(0.06, rel=0.05)


def test_a_wild_measurement_moves_a_trusted_fit_little() -> None:
    """A step or copy that waited seconds for a busy machine is clipped."""
    rng = random.Random(2)
    costs = CostModel(block_size=16, min_samples=4)
    for _ in range(200):
        costs.observe_step(*random_step(rng))
    for num_blocks in [1, 5, 9] * 20:
        costs.observe_offload(num_blocks, 0.001 * num_blocks)
        costs.observe_restore(num_blocks, 0.001 * num_blocks)
    before = costs.recompute_s(4096), costs.offload_restore_s(10)
    costs.observe_step(prefill_step(0, 512), 0, 500.0)  # about 1000 times too slow
    costs.observe_offload(10, 10.0)
    after = costs.recompute_s(4096), costs.offload_restore_s(10)
    assert after == (pytest.approx(before[0], rel=0.2), pytest.approx(before[1], rel=0.2))
    for _ in range(40):  # re-solved (every 16 steps) with the wild step in its window
        costs.observe_step(*random_step(rng))
        assert costs.recompute_s(4096) == pytest.approx(before[0], rel=0.2)


@pytest.mark.parametrize("slow_blocks", [1, 50, 256])
def test_one_far_off_copy_before_the_fit_is_trusted_is_forgotten_within_a_few_copies(
        slow_blocks: int) -> None:
    """One copy 100x slow, then fast ones: least squares over forgotten
    copies gave large copies a negative (or 30x) per-block cost for 100-300
    copies, so AUTO took large offloads for free; medians shrug it off."""
    def seconds(num_blocks: int) -> float:
        return 0.002 + 1e-4 * num_blocks

    costs = CostModel(block_size=16, min_samples=4)
    for num_blocks in [slow_blocks, 5, 9, 1, 30, 120, 2, 64]:
        slow = 100 if costs.num_offloads == 0 else 1
        costs.observe_offload(num_blocks, seconds(num_blocks) * slow)
        costs.observe_restore(num_blocks, seconds(num_blocks) * slow)
        if costs.num_offloads >= 4:  # trusted from here on
            e = costs.estimates()
            assert e.offload_s_per_block is not None and e.offload_s_per_block >= 0
            assert e.offload_s_fixed is not None and e.offload_s_fixed >= 0
    e = costs.estimates()
    assert (e.offload_s_fixed, e.offload_s_per_block) == (
        pytest.approx(0.002, rel=0.05), pytest.approx(1e-4, rel=0.05))
    assert costs.offload_restore_s(256) == pytest.approx(2 * seconds(256), rel=0.05)


def test_copy_fit_holds_the_line_through_occasional_slow_copies() -> None:
    """One copy in eight 20x slow (a busy machine) barely moves the fit."""
    costs = CostModel(block_size=16, min_samples=4)
    rng = random.Random(4)
    for i in range(100):
        num_blocks = rng.randint(1, 256)
        slow = 20 if i % 8 == 3 else 1
        costs.observe_offload(num_blocks, (0.004 + 1e-4 * num_blocks) * slow)
        costs.observe_restore(num_blocks, (0.002 + 3e-4 * num_blocks) * slow)
        if costs.num_offloads > 16:
            assert costs.offload_restore_s(100) == pytest.approx(0.006 + 4e-4 * 100, rel=0.1)


def test_nnls_is_least_squares_with_no_coefficient_below_zero() -> None:
    """Where the unconstrained answer has a negative coefficient, nnls holds it
    at 0 and fits the rest: checked against every subset of coefficients."""
    rng = random.Random(3)
    rows = [[1.0, rng.uniform(1, 50), rng.uniform(1, 9)] for _ in range(200)]
    # The third coefficient negative: unconstrained least squares gives it -2.
    targets = [0.5 + 0.1 * x[1] - 2.0 * x[2] + rng.gauss(0, 0.3) for x in rows]
    theta = nnls(*normal_equations(rows, targets))
    assert min(theta) >= 0 and theta[2] == 0

    def loss(t: list[float]) -> float:
        return sum((sum(c * x for c, x in zip(t, row, strict=True)) - y) ** 2
                   for row, y in zip(rows, targets, strict=True))
    for keep in ([0], [1], [0, 1], [0, 2], [1, 2]):  # any feasible subset does no better
        sub = nnls(*normal_equations([[row[i] for i in keep] for row in rows], targets))
        full = [0.0] * 3
        for i, c in zip(keep, sub, strict=True):
            full[i] = c
        assert loss(theta) <= loss(full) * (1 + 1e-9)
    # A fit with nothing to hold at 0 is plain least squares (exact data).
    exact = [0.5 + 0.1 * x[1] + 2.0 * x[2] for x in rows]
    assert nnls(*normal_equations(rows, exact)) == pytest.approx([0.5, 0.1, 2.0], rel=1e-6)


def true_prefill_s(start: int, length: int) -> float:
    end = start + length
    return C + A * length + B * (end * end - start * start)


def test_one_far_off_step_before_the_fit_is_trusted_is_shrugged_off() -> None:
    """A process's first step 100x slow, then true ones: least squares over
    forgotten steps, clipped only once trusted, gave the prefill tokens a
    negative cost and recompute_s(4000) 1131 s against 1.28 s, still 30 s
    after 1,000 steps; AUTO offloaded where recomputing was cheaper."""
    costs = CostModel(block_size=16, min_samples=4)
    rng = random.Random(5)
    chunks = [(0, 512), (0, 64), (100, 200), (300, 30)]
    chunks += [(rng.randint(0, 3000), rng.randint(1, 512)) for _ in range(36)]
    true = A * 4000 + B * 4000**2
    for k, (start, length) in enumerate(chunks):
        seconds = true_prefill_s(start, length) * (100 if k == 0 else 1)
        costs.observe_step(prefill_step(start, length), 0, seconds * (1 + rng.gauss(0, 0.02)))
        if costs.num_prefill_steps >= 4:
            predicted = costs.recompute_s(4000)
            assert predicted is not None and predicted > 0
            assert min(costs.step.theta) >= 0
            if k >= 24:
                assert predicted == pytest.approx(true, rel=0.1)


@pytest.mark.parametrize("seed", range(4))
def test_one_step_measured_10x_fast_moves_the_fit_little(seed: int) -> None:
    """Errors relative to each step's own seconds gave one step measured 10x
    faster than it ran 100x its neighbours' weight: recompute_s(4000) went
    50-80% off for a window, in prefill-only and mixed runs alike."""
    rng = random.Random(seed)
    true = A * 4000 + B * 4000**2
    prefills = CostModel(block_size=16, min_samples=4)
    for k in range(60):
        start, length = rng.randint(0, 3000), rng.randint(1, 512)
        seconds = true_prefill_s(start, length) * (0.1 if k == 10 else 1)
        prefills.observe_step(prefill_step(start, length), 0, seconds * (1 + rng.gauss(0, 0.02)))
        if k >= 8:
            assert prefills.recompute_s(4000) == pytest.approx(true, rel=0.2), k
    mixed = CostModel(block_size=16, min_samples=4)
    for k in range(100):
        seqs, num_decodes, seconds = random_step(rng)
        mixed.observe_step(seqs, num_decodes, seconds * (0.1 if k == 30 else 1))
        if k >= 20:
            assert mixed.recompute_s(4000) == pytest.approx(true, rel=0.2), k


def test_a_few_slow_first_steps_among_decodes_do_not_outlast_a_few_dozen() -> None:
    """Several of a process's first steps (prefill and decode alike) 20-100x
    slow, then mixed true ones: within a few dozen the rates are right and no
    coefficient ever went below 0."""
    rng = random.Random(6)
    costs = CostModel(block_size=16, min_samples=4)
    for k in range(60):
        seqs, num_decodes, seconds = random_step(rng)
        costs.observe_step(seqs, num_decodes, seconds * (rng.choice((20, 100)) if k < 3 else 1))
        assert min(costs.step.theta) >= 0
    estimates = costs.estimates()
    assert estimates.prefill_s_per_token == pytest.approx(A, rel=0.1)
    assert estimates.prefill_s_per_token_squared == pytest.approx(B, rel=0.1)
    assert costs.recompute_s(4000) == pytest.approx(A * 4000 + B * 4000**2, rel=0.1)


def test_nothing_is_predicted_before_enough_is_measured() -> None:
    costs = CostModel(block_size=16, min_samples=4)
    for num_blocks in (1, 2, 3):
        costs.observe_offload(num_blocks, 0.01)
        costs.observe_restore(num_blocks, 0.01)
    # Decode-only steps teach nothing about prefill.
    decode = [ScheduledSeq("d", [1], 50, [], True, SamplingParams(1))]
    for _ in range(10):
        costs.observe_step(decode, 1, 0.01)
    for start in (0, 10, 20):
        costs.observe_step(prefill_step(start, 10), 0, 0.01)
    assert costs.offload_restore_s(4) is None and costs.recompute_s(40) is None
    estimates = costs.estimates()
    assert all(getattr(estimates, f.name) is None for f in fields(estimates))
    costs.observe_offload(4, 0.02)
    assert costs.offload_restore_s(4) is None  # no fourth restore yet
    costs.observe_restore(4, 0.02)
    costs.observe_step(prefill_step(30, 10), 0, 0.01)
    assert costs.offload_restore_s(4) is not None and costs.recompute_s(40) is not None


def test_crossover_is_where_the_predictions_meet() -> None:
    costs = CostModel(block_size=16, min_samples=4)
    teach_costs(costs, offload=(0.01, 2e-4), restore=(0.005, 1e-4), prefill=(1e-4, 1e-7))
    crossover = costs.estimates().crossover_tokens
    # Analytically: 1e-7 L^2 + (1e-4 - 3e-4 / 16) L - 0.015 = 0.
    linear = 1e-4 - 3e-4 / 16
    expected = (-linear + math.sqrt(linear**2 + 4 * 1e-7 * 0.015)) / (2 * 1e-7)
    assert crossover == pytest.approx(expected, rel=1e-6)
    assert 100 < crossover < 1000
    below, above = math.floor(crossover / 16) * 16, math.ceil(crossover / 16) * 16
    assert costs.recompute_s(below) < costs.offload_restore_s(below // 16)
    assert costs.recompute_s(above) > costs.offload_restore_s(above // 16)


def test_schedule_marks_its_decodes_and_its_steps_teach_the_prefill_fit() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_len=4)
    step(scheduler)
    add(scheduler, "b", prompt_len=6, first_token=50)
    output, _ = step(scheduler)
    assert [len(s.token_ids) for s in output.seqs] == [1, 6] and output.num_decodes == 1
    costs = scheduler.preemption.costs
    scheduler.observe_step(output, 0.01)
    assert costs.num_prefill_steps == 1
    output, _ = step(scheduler)
    assert output.num_decodes == len(output.seqs) == 2
    scheduler.observe_step(output, 0.01)
    assert costs.num_prefill_steps == 1  # a step of decodes only
