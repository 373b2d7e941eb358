"""Sampling: greedy, temperature, top-k, top-p, and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.sampling import SamplingParams, filtered_probs, sample
from kvstash.errors import InvalidArgument
from tests.gpu_worker.worker_factories import blocks_for, greedy_generate, make_runner, prompt

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9, -1.0])


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_greedy_is_argmax() -> None:
    assert sample(LOGITS, SamplingParams(), 0, _gen()) == 1


def test_top_k_keeps_only_the_k_best() -> None:
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert set(torch.nonzero(probs).flatten().tolist()) == {1, 4}
    draws = {sample(LOGITS, SamplingParams(temperature=1.0, top_k=2, seed=s), 5, _gen())
             for s in range(200)}
    assert draws == {1, 4}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.softmax(LOGITS.double(), -1)
    kept = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.5))
    # Sorted: token 1 (~0.38), token 4 (~0.35): together past 0.5, so exactly these two.
    assert set(torch.nonzero(kept).flatten().tolist()) == {1, 4}
    assert kept[1] / kept[4] == pytest.approx((probs[1] / probs[4]).item())
    tiny_p = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6))
    assert torch.nonzero(tiny_p).flatten().tolist() == [1]


def test_temperature_sharpens_and_flattens() -> None:
    cold = filtered_probs(LOGITS, SamplingParams(temperature=0.1))
    hot = filtered_probs(LOGITS, SamplingParams(temperature=10.0))
    assert cold[1] > 0.5 and hot.max() < 0.3


def test_draws_follow_the_distribution() -> None:
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3000)]
    counts = torch.bincount(torch.tensor([sample(LOGITS, p, 0, _gen()) for p in params]),
                            minlength=6)
    expected = torch.softmax(LOGITS.double(), -1) * 3000
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5)


def test_seeded_draw_is_a_function_of_seed_position_and_logits() -> None:
    p = SamplingParams(temperature=1.5, seed=1234)
    first = [sample(LOGITS, p, pos, _gen()) for pos in range(64)]
    again = [sample(LOGITS, p, pos, torch.Generator().manual_seed(99)) for pos in range(64)]
    assert first == again
    other_seed = [sample(LOGITS, SamplingParams(temperature=1.5, seed=1235), pos, _gen())
                  for pos in range(64)]
    assert first != other_seed
    assert len(set(first)) > 2  # positions give different draws


def test_unseeded_draws_use_the_process_generator() -> None:
    gen = _gen()
    p = SamplingParams(temperature=1.0)
    draws = [sample(LOGITS, p, 7, gen) for _ in range(50)]
    assert len(set(draws)) > 1  # same position, different draws
    gen2 = _gen()
    assert [sample(LOGITS, p, 7, gen2) for _ in range(50)] == draws


def test_seeded_generation_survives_recompute_and_chunking() -> None:
    """A request recomputed after preemption (prefill of prompt + output so far,
    in chunks, into other blocks) draws the same tokens as before. float64, as
    the project's oracle runs: chunking changes float32 rounding."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    ids = prompt("Once upon a time")
    out = greedy_generate(make_runner(torch.float64), ids, 20, blocks_for(40), sampling=params)
    redo = make_runner(torch.float64)
    seen = ids + out[:10]
    again = greedy_generate(redo, seen, 10, blocks_for(40, first=20), chunk=7, sampling=params)
    assert again == out[10:]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"temperature": float("nan")}, "temperature must be >= 0, got nan"),
        ({"top_k": -1}, "top_k must be >= 0, got -1"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"seed": -3}, "seed must be in"),
    ],
)
def test_bad_params_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
