"""Next-token choice for a whole step at once, on the model's device: greedy, or
temperature with top-k / top-p.

Contract of a seeded draw: the token is a pure function of (seed, position of
the sampled token, logits). The uniform number u that picks it is computed on
the host from (seed, position) alone:

    u = (splitmix64(draw_seed(seed, position)) >> 11) / 2**53      (53 random bits)

so a request recomputed after preemption draws exactly the tokens it drew
before, whichever rows share its step. Unseeded rows take u from the runner's
process generator. u travels to the device with the other step inputs; the
device pushes it through the inverse CDF of the kept tokens (in token-id
order), in float64. Every operation is per row (no reduction crosses rows),
and rows are processed in tiles of a fixed number of rows, so a row's token
does not depend on the other rows of its step.

Filtering, row by row: logits / temperature; top-k keeps the k highest (ties
with the k-th included); top-p keeps the shortest prefix, in descending order
of probability (stable: lower token id first), whose mass reaches top_p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstash.common.sampling import GREEDY, SamplingParams

__all__ = ["GREEDY", "SamplingBatch", "SamplingParams", "draw_seed", "filtered_rows",
           "sample_rows", "seeded_uniform"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, position: int) -> int:
    """Mixes so that nearby (seed, position) pairs give unrelated streams."""
    return _splitmix64(_splitmix64(seed) ^ position)


def seeded_uniform(seed: int, position: int) -> float:
    """The u of a seeded draw, in [0, 1): exact in float64 (53 bits)."""
    return (_splitmix64(draw_seed(seed, position)) >> 11) * 2.0**-53


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row sampling inputs of a step, host side (float64 / int64 arrays)."""

    temperature: np.ndarray  # 0 = greedy
    top_k: np.ndarray  # 0 = off
    top_p: np.ndarray  # 1.0 = off
    uniform: np.ndarray  # u of each row's draw (0 for greedy rows)

    @staticmethod
    def build(params: Sequence[SamplingParams], positions: Sequence[int],
              process_gen: torch.Generator) -> SamplingBatch:
        """`positions[i]`: where row i's token goes. Unseeded rows consume the
        process generator in row order."""
        uniform = np.zeros(len(params), dtype=np.float64)
        unseeded = [i for i, p in enumerate(params) if not p.greedy and p.seed is None]
        if unseeded:
            drawn = torch.rand(len(unseeded), generator=process_gen, dtype=torch.float64)
            uniform[unseeded] = drawn.numpy()
        for i, (p, pos) in enumerate(zip(params, positions, strict=True)):
            if not p.greedy and p.seed is not None:
                uniform[i] = seeded_uniform(p.seed, pos)
        return SamplingBatch(
            temperature=np.array([p.temperature for p in params], dtype=np.float64),
            top_k=np.array([p.top_k for p in params], dtype=np.int64),
            top_p=np.array([p.top_p for p in params], dtype=np.float64),
            uniform=uniform,
        )

    @property
    def any_random(self) -> bool:
        return bool((self.temperature > 0).any())

    @property
    def any_filter(self) -> bool:
        return bool(((self.top_k > 0) | (self.top_p < 1.0)).any())


@dataclass(frozen=True, slots=True)
class DeviceSampling:
    """SamplingBatch columns on the device, plus what the host knows about them
    (so that no branch needs a device read)."""

    temperature: torch.Tensor  # [rows] float64
    top_k: torch.Tensor  # [rows] int64
    top_p: torch.Tensor  # [rows] float64
    uniform: torch.Tensor  # [rows] float64
    any_random: bool
    any_filter: bool


def filtered_rows(logits: torch.Tensor, s: DeviceSampling, filters: bool) -> torch.Tensor:
    """Probabilities [rows, vocab] float64 after temperature, top-k, top-p;
    filtered tokens are exactly 0. Greedy rows come out as temperature 1."""
    temperature = torch.where(s.temperature > 0, s.temperature, 1.0)
    scaled = logits.to(torch.float64) / temperature[:, None]
    if not filters:
        return torch.softmax(scaled, dim=-1)
    vocab = scaled.shape[-1]
    sorted_scaled, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    k = torch.where((s.top_k > 0) & (s.top_k < vocab), s.top_k, vocab)
    kth = sorted_scaled.gather(1, (k - 1)[:, None])
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs = probs.gather(1, order)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # Rows with top_p == 1 keep everything: rounding may push mass_before to 1.
    drop_sorted = (mass_before >= s.top_p[:, None]) & (s.top_p < 1.0)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    # Only rows that dropped tokens are renormalised: a row that drops none
    # keeps its softmax's bits, which the unfiltered path gives it too, so
    # what its neighbours ask for cannot move its draw.
    dropped = drop.any(dim=-1, keepdim=True)
    return torch.where(dropped, probs / probs.sum(dim=-1, keepdim=True), probs)


def _sample_tile(logits: torch.Tensor, s: DeviceSampling) -> torch.Tensor:
    greedy = torch.argmax(logits, dim=-1)
    if not s.any_random:
        return greedy
    probs = filtered_rows(logits, s, s.any_filter)
    cdf = torch.cumsum(probs, dim=-1)
    target = (s.uniform * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    # Rounding can leave cdf[-1] a hair under 1; never pick past the last kept token.
    ids = torch.arange(probs.shape[-1], device=probs.device)
    last_kept = torch.where(probs > 0, ids, 0).amax(dim=-1)
    drawn = torch.minimum(index, last_kept)
    # Logits not all finite (an overflow: +inf, NaN) leave no distribution
    # (its cdf is NaN, and every draw came out token 0, even one whose logit
    # is -inf): such a row takes the greedy token, an +inf logit's limit.
    return torch.where((s.temperature > 0) & cdf[:, -1].isfinite(), drawn, greedy)


def sample_rows(logits: torch.Tensor, s: DeviceSampling, tile: int | None) -> torch.Tensor:
    """Token ids [rows] (int64, on the logits' device) for logits [rows, vocab].
    With `tile`, rows go through in slices of exactly `tile` rows (the caller
    pads), so every kernel sees one shape whatever the batch."""
    rows = logits.shape[0]
    step = tile or max(rows, 1)
    if rows % step:
        raise ValueError(f"{rows} rows are not a multiple of the sampling tile {step}")
    out = [_sample_tile(logits[i:i + step], _rows(s, i, step)) for i in range(0, rows, step)]
    return torch.cat(out) if len(out) != 1 else out[0]


def _rows(s: DeviceSampling, start: int, count: int) -> DeviceSampling:
    cut = slice(start, start + count)
    return DeviceSampling(s.temperature[cut], s.top_k[cut], s.top_p[cut], s.uniform[cut],
                          s.any_random, s.any_filter)


def to_device(batch: SamplingBatch, device: torch.device) -> DeviceSampling:
    """For tests; the runner stages its columns with the step."""
    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return DeviceSampling(put(batch.temperature), put(batch.top_k), put(batch.top_p),
                          put(batch.uniform), batch.any_random, batch.any_filter)

