"""Next-token choice: greedy, or temperature with top-k / top-p.

A seeded draw is a pure function of (seed, position of the sampled token,
logits): the uniform number comes from a generator seeded with both, so a
request recomputed after preemption draws exactly the tokens it drew before.
Unseeded requests share the runner's process generator.

The draw is one uniform number u pushed through the inverse CDF of the kept
tokens, in float64 on the CPU, so it does not depend on the device's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstash.errors import InvalidArgument

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    seed: int | None = None  # reproducible draws; None = process generator

    def __post_init__(self) -> None:
        # InvalidArgument is a ValueError: bad values here come from callers.
        if not self.temperature >= 0.0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= _MASK64:
            raise InvalidArgument(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, position: int) -> int:
    """Mixes so that nearby (seed, position) pairs give unrelated streams."""
    return _splitmix64(_splitmix64(seed) ^ position)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [vocab] (float64, CPU) after temperature, top-k and top-p;
    filtered-out tokens get exactly 0."""
    scaled = logits.detach().to("cpu", torch.float64) / params.temperature
    vocab = scaled.shape[0]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum()


def sample(logits: torch.Tensor, params: SamplingParams, position: int,
           process_gen: torch.Generator) -> int:
    """The token to place at `position`, given the logits [vocab] that predict it."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits, params)
    if params.seed is None:
        gen = process_gen
    else:
        gen = torch.Generator().manual_seed(draw_seed(params.seed, position))
    u = torch.rand((), generator=gen, dtype=torch.float64)
    cdf = torch.cumsum(probs, dim=-1)
    # Rounding can leave cdf[-1] a hair under 1; never pick past the last kept token.
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    last_kept = int(torch.nonzero(probs).max())
    return min(index, last_kept)
