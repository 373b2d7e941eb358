"""Sampling: greedy, temperature, top-k, top-p, seeded reproducibility, and the
batched on-device sampler (a row draws the same token in any batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.runner import SeqWork
from gpu_worker.sampling import (
    GREEDY,
    SamplingBatch,
    SamplingParams,
    filtered_rows,
    sample_rows,
    seeded_uniform,
    to_device,
)
from kvstash.errors import InvalidArgument
from tests.gpu_worker.oracle import filtered_probs, sample
from tests.gpu_worker.worker_factories import blocks_for, greedy_generate, make_runner, prompt

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9, -1.0])


def params(**kwargs: float | int | None) -> SamplingParams:
    return SamplingParams(max_tokens=8, **kwargs)  # type: ignore[arg-type]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_greedy_is_argmax() -> None:
    assert sample(LOGITS, GREEDY, 0, _gen()) == 1


def test_top_k_keeps_only_the_k_best() -> None:
    probs = filtered_probs(LOGITS, params(temperature=1.0, top_k=2))
    assert set(torch.nonzero(probs).flatten().tolist()) == {1, 4}
    draws = {sample(LOGITS, params(temperature=1.0, top_k=2, seed=s), 5, _gen())
             for s in range(200)}
    assert draws == {1, 4}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.softmax(LOGITS.double(), -1)
    kept = filtered_probs(LOGITS, params(temperature=1.0, top_p=0.5))
    # Sorted: token 1 (~0.38), token 4 (~0.35): together past 0.5, so exactly these two.
    assert set(torch.nonzero(kept).flatten().tolist()) == {1, 4}
    assert kept[1] / kept[4] == pytest.approx((probs[1] / probs[4]).item())
    tiny_p = filtered_probs(LOGITS, params(temperature=1.0, top_p=1e-6))
    assert torch.nonzero(tiny_p).flatten().tolist() == [1]


def test_temperature_sharpens_and_flattens() -> None:
    cold = filtered_probs(LOGITS, params(temperature=0.1))
    hot = filtered_probs(LOGITS, params(temperature=10.0))
    assert cold[1] > 0.5 and hot.max() < 0.3


def test_draws_follow_the_distribution() -> None:
    settings = [params(temperature=1.0, seed=s) for s in range(3000)]
    counts = torch.bincount(torch.tensor([sample(LOGITS, p, 0, _gen()) for p in settings]),
                            minlength=6)
    expected = torch.softmax(LOGITS.double(), -1) * 3000
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5)


def test_seeded_draw_is_a_function_of_seed_position_and_logits() -> None:
    p = params(temperature=1.5, seed=1234)
    first = [sample(LOGITS, p, pos, _gen()) for pos in range(64)]
    again = [sample(LOGITS, p, pos, torch.Generator().manual_seed(99)) for pos in range(64)]
    assert first == again
    other_seed = [sample(LOGITS, params(temperature=1.5, seed=1235), pos, _gen())
                  for pos in range(64)]
    assert first != other_seed
    assert len(set(first)) > 2  # positions give different draws


def test_unseeded_draws_use_the_process_generator() -> None:
    gen = _gen()
    p = params(temperature=1.0)
    draws = [sample(LOGITS, p, 7, gen) for _ in range(50)]
    assert len(set(draws)) > 1  # same position, different draws
    gen2 = _gen()
    assert [sample(LOGITS, p, 7, gen2) for _ in range(50)] == draws


def test_seeded_generation_survives_recompute_and_chunking() -> None:
    """A request recomputed after preemption (prefill of prompt + output so far,
    in chunks, into other blocks) draws the same tokens as before. float64, as
    the project's oracle runs: chunking changes float32 rounding."""
    setting = params(temperature=0.9, top_p=0.95, seed=42)
    ids = prompt("Once upon a time")
    out = greedy_generate(make_runner(torch.float64), ids, 20, blocks_for(40), sampling=setting)
    redo = make_runner(torch.float64)
    seen = ids + out[:10]
    again = greedy_generate(redo, seen, 10, blocks_for(40, first=20), chunk=7, sampling=setting)
    assert again == out[10:]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be finite and >= 0, got -0.5"),
        ({"temperature": float("nan")}, "temperature must be finite and >= 0, got nan"),
        ({"top_k": -1}, "top_k must be >= 0, got -1"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"seed": -3}, "seed must be in"),
    ],
)
def test_bad_params_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        SamplingParams(max_tokens=8, **kwargs)  # type: ignore[arg-type]


def test_a_tiny_temperature_never_samples_a_token_the_head_blocks() -> None:
    """Below SAMPLING_EPS a temperature is greedy, as in vLLM: a subnormal one
    overflowed the logits to inf and drew token 0, which the tiny head blocks."""
    runner = make_runner()
    ids = prompt("Hello there")
    [greedy] = runner.execute([SeqWork("a", ids, 0, [0, 1, 2, 3], True)])
    for i, temperature in enumerate([1e-310, 5e-324, 1e-6]):
        tiny = params(temperature=temperature, seed=1)
        assert tiny.greedy and tiny.temperature == 0.0
        blocks = [4 * i + 4 + b for b in range(4)]
        assert runner.execute([SeqWork("b", ids, 0, blocks, True, tiny)]) == [greedy]
    assert not params(temperature=1e-5).greedy


def test_seeded_uniform_is_53_exact_bits_of_splitmix() -> None:
    # Frozen values: changing them changes every seeded request's output.
    assert seeded_uniform(0, 0) == pytest.approx(0.1387094101, abs=1e-10)
    assert seeded_uniform(42, 17) == pytest.approx(0.0015380156, abs=1e-10)
    draws = [seeded_uniform(7, pos) for pos in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert all((u * 2**53).is_integer() for u in draws)
    assert abs(float(np.mean(draws)) - 0.5) < 0.03


def test_greedy_ties_pick_the_lowest_token_id() -> None:
    assert sample(torch.tensor([0.5, 2.0, 2.0, 1.0]), GREEDY, 0, _gen()) == 1


ROW_SETTINGS = [GREEDY, params(temperature=0.7, seed=1), params(temperature=1.3, top_k=3, seed=2),
                params(temperature=1.0, top_p=0.6, seed=3),
                params(temperature=0.9, top_k=50, top_p=0.9, seed=4)]


def _batch_tokens(logits: torch.Tensor, settings: list[SamplingParams],
                  positions: list[int], tile: int | None) -> list[int]:
    batch = SamplingBatch.build(settings, positions, _gen())
    return sample_rows(logits, to_device(batch, logits.device), tile).tolist()


def test_batched_rows_draw_what_each_row_draws_alone() -> None:
    """A row's token does not depend on the rows beside it: tiles with and
    without filters, greedy neighbours, other positions, other sizes."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 300, generator=gen) * 3
    settings = [ROW_SETTINGS[i % len(ROW_SETTINGS)] for i in range(40)]
    positions = list(range(100, 140))
    alone = [sample(logits[i], settings[i], positions[i], _gen()) for i in range(40)]
    assert _batch_tokens(logits, settings, positions, None) == alone
    assert _batch_tokens(logits, settings, positions, 8) == alone
    assert _batch_tokens(logits.flip(0), settings[::-1], positions[::-1], 4) == alone[::-1]
    assert len(set(alone)) > 10


def test_filtered_rows_beside_unfiltered_rows_keep_their_distribution() -> None:
    """Rows with top_p = 1 in a tile that sorts for a neighbour's top_p keep
    every token (rounding must not drop the tail)."""
    logits = torch.linspace(-30, 5, 300)[None].repeat(2, 1)
    batch = SamplingBatch.build([params(temperature=1.0), params(temperature=1.0, top_p=0.5)],
                                [0, 0], _gen())
    probs = filtered_rows(logits, to_device(batch, logits.device), filters=True)
    assert int((probs[0] > 0).sum()) == 300
    assert int((probs[1] > 0).sum()) < 10


def test_a_neighbours_filter_leaves_an_unfiltered_rows_probabilities_bit_for_bit() -> None:
    """A row without top-k or top-p gets the same probabilities, to the bit,
    whether or not another row of its step filters (so its seeded draw stays
    a function of its own seed, position and logits); a filtered row that
    drops tokens is renormalised over what it keeps."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 300, generator=gen, dtype=torch.float64) * 4
    rows = [params(temperature=0.7), params(temperature=1.3, seed=3),
            params(temperature=1.0, top_p=0.5), params(temperature=0.9, top_k=7)]
    batch = to_device(SamplingBatch.build(rows, [0] * 4, _gen()), logits.device)
    filtered = filtered_rows(logits, batch, filters=True)
    plain = filtered_rows(logits, batch, filters=False)
    assert torch.equal(filtered[:2], plain[:2])
    assert int((filtered[2] > 0).sum()) < 300 and int((filtered[3] > 0).sum()) == 7
    torch.testing.assert_close(filtered[2:].sum(-1), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("overflow", [float("inf"), float("nan")])
def test_a_row_whose_logits_overflowed_takes_the_greedy_token(overflow: float) -> None:
    """Its softmax is NaN everywhere: every draw came out token 0, whose
    logit here is -inf (probability exactly 0)."""
    logits = torch.tensor([[float("-inf"), 1.0, overflow, 2.0]], dtype=torch.float32)
    greedy = int(torch.argmax(logits))
    for seed in range(8):
        for params in (SamplingParams(8, temperature=1.0, seed=seed),
                       SamplingParams(8, temperature=0.7, top_p=0.9, top_k=3, seed=seed)):
            batch = SamplingBatch.build([params], [7], torch.Generator())
            assert int(sample_rows(logits, to_device(batch, logits.device), None)[0]) == greedy
