"""What a preemption costs, learned from the engine's own measurements.

Two ways to bring a preempted decode back, each predicted in seconds:

    offload + restore   copy n KV blocks out and back in:
                            (u_off + v_off * n) + (u_res + v_res * n)
                        fitted on the latest successful offloads and
                        restores (blocks copied, seconds from command to
                        answer; copy_fit.py)
    recompute           prefill its L positions again:  a * L + b * L^2
                        (attention makes later positions dearer)

The prefill rates come from the step loop: a step's wall time is modelled as

    c + d * D + e * sum(decode positions) + a * T + b * sum((s + n)^2 - s^2)
                                                   over its prefill chunks [s, s + n)

with D decode rows and T prefill tokens. Positions [s, s + n) cost
t(s + n) - t(s) under t(L) = a * L + b * L^2, so a chunked prefill of L
positions costs t(L) in all, however it was chunked; the step's own cost
(c) and its decodes (d, e) are what recomputing does not add: a victim is
recomputed beside the decodes that kept running, in steps that run anyway.
Its leading blocks that requests which keep running hold too stay cached,
so it prefills only the positions after them (`prefill_s`, preemption.py);
its own cached blocks, freed, may be evicted before it is readmitted
(so may those only other victims held): nothing counts on them.

The step fit is least squares over exponentially forgotten samples
(`_FORGET_STEP`), kept as its normal equations and solved when asked: pure
Python, a 5x5 system. A fit is trusted once `min_samples` of its samples
were measured (for the steps: steps with prefill chunks); from then on a step
far off its prediction is clipped (`_MAX_RATIO`). A prediction of zero or
less counts as none.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations_with_replacement, islice

from scheduler_svc.core.copy_fit import CopyFit
from scheduler_svc.core.seq import ScheduledSeq

# Weight left to a step after each newer one: the fit's memory is about the
# last 1000 steps (seconds of serving).
_FORGET_STEP = 0.999
# Once a fit is trusted, a sample more than this many times off its prediction
# counts as only this far off: a step that waited seconds for a busy CPU (seen
# on the 2-core machine, against milliseconds usually) moves it no further
# than a plain slow one. The prediction it is bounded by is re-solved every
# 1/16 of a fit's memory: every 62 steps.
_MAX_RATIO = 4.0
# Added to the diagonal of the scaled normal equations: a direction no sample
# has told apart (two features always in proportion) gets the least-norm answer.
_RIDGE = 1e-9
# LinearFit's sums come back to a sample weight of 1 past this one (every
# 345,000 steps): far below overflow, squared features included.
_RESCALE = 1e150
_START_POS = operator.attrgetter("start_pos")


class LinearFit:
    """y ~ theta . x by exponentially weighted least squares.

    A sample's weight shrinks by `forget` with each newer one. Rather than
    scale every sum down at each sample, the sums take the n-th sample
    weighted up by 1 / forget^n, and come back down to a weight of 1 when
    it passes _RESCALE; `_solve` scales its equations to a unit diagonal,
    so the common factor drops out. A sample's features that are 0 add
    nothing: a step without prefill chunks (two of the five features 0)
    adds 9 products to the sums, where every sample used to add 20 and
    scale all 20 sums down (kvstash sim: 2.3-2.7 against 4.8-6.8 us a step
    with the core compiled)."""

    __slots__ = ("_clip_every", "_forget", "_gram", "_moment", "_reference", "_theta",
                 "_weight", "num_samples")

    def __init__(self, num_features: int, forget: float) -> None:
        self._forget = forget
        self._clip_every = max(1, round(1 / (1 - forget) / 16)) if forget < 1 else 64
        # sum w x x^T (symmetric): its upper triangle, row after row, in one list
        self._gram = [0.0] * (num_features * (num_features + 1) // 2)
        self._moment = [0.0] * num_features  # sum w x y
        self._weight = 1.0  # w of the newest sample; the next one's is w / forget
        self._theta: list[float] | None = None  # solved lazily; None: stale
        self._reference: list[float] | None = None  # the theta samples are clipped by
        self.num_samples = 0

    def add(self, x: Sequence[float], y: float, clip: bool) -> None:
        """One measurement; `clip`: bound it by the prediction (see _MAX_RATIO)."""
        if clip:
            if self._reference is None or not self.num_samples % self._clip_every:
                self._reference = self.theta
            expected = _dot(self._reference, x)
            if expected > 0:
                y = min(max(y, expected / _MAX_RATIO), expected * _MAX_RATIO)
        weight = self._weight = self._weight / self._forget
        gram, moment = self._gram, self._moment
        n = len(moment)
        row = 0  # where feature i's row of the upper triangle starts
        for i in range(n):
            xi = x[i]
            if xi:
                wxi = weight * xi
                moment[i] += wxi * y
                for j in range(i, n):
                    xj = x[j]
                    if xj:
                        gram[row + j - i] += wxi * xj
            row += n - i
        if weight > _RESCALE:
            self._gram = [g / weight for g in gram]
            self._moment = [m / weight for m in moment]
            self._weight = 1.0
        self._theta = None
        self.num_samples += 1

    @property
    def theta(self) -> list[float]:
        if self._theta is None:
            self._theta = _solve(self._gram, self._moment)
        return self._theta

    def predict(self, x: Sequence[float]) -> float:
        return _dot(self.theta, x)


def _dot(theta: Sequence[float], x: Sequence[float]) -> float:
    total = 0.0
    for t, xi in zip(theta, x, strict=True):
        total += t * xi
    return total


def _solve(upper: list[float], moment: list[float]) -> list[float]:
    """theta with gram @ theta = moment (`upper`: gram's upper triangle, row
    after row), scaled to a unit diagonal first (the features differ by many
    orders of magnitude); features never seen get 0."""
    n = len(moment)
    gram = [[0.0] * n for _ in range(n)]
    for value, (i, j) in zip(upper, combinations_with_replacement(range(n), 2), strict=True):
        gram[i][j] = gram[j][i] = value
    seen = [i for i in range(n) if gram[i][i] > 0]
    scale = {i: 1 / math.sqrt(gram[i][i]) for i in seen}
    # One row per seen feature: [scaled gram + ridge | scaled moment].
    rows = [[gram[i][j] * scale[i] * scale[j] + (_RIDGE if i == j else 0.0) for j in seen]
            + [moment[i] * scale[i]] for i in seen]
    size = len(rows)
    for col in range(size):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        head = rows[col]
        for r in range(size):
            if r != col and (factor := rows[r][col] / head[col]):
                rows[r] = [v - factor * h for v, h in zip(rows[r], head, strict=True)]
    theta = [0.0] * len(moment)
    for k, i in enumerate(seen):
        theta[i] = rows[k][size] / rows[k][k] * scale[i]
    return theta


def step_features(seqs: Sequence[ScheduledSeq], num_decodes: int
                  ) -> tuple[float, float, float, float, float]:
    """What the step model's coefficients (c, d, e, a, b above) multiply:
    1, decode rows, the sum of their positions, prefill tokens and the sum of
    (s + n)^2 - s^2 over the prefill chunks [s, s + n); `seqs[:num_decodes]`
    are the decodes. kvstash sim times its steps by the same line."""
    decode_positions = sum(map(_START_POS, islice(seqs, num_decodes)))
    num_prefill = prefill_squares = 0
    for seq in islice(seqs, num_decodes, None):
        start = seq.start_pos
        end = start + len(seq.token_ids)
        num_prefill += end - start
        prefill_squares += end * end - start * start
    return (1.0, num_decodes, decode_positions, num_prefill, prefill_squares)


@dataclass(frozen=True, slots=True)
class CostEstimates:
    """The fitted rates (None until trusted), for metrics and benchmarks."""

    # Seconds of one offload: fixed part, and per block copied.
    offload_s_fixed: float | None
    offload_s_per_block: float | None
    # Seconds of one restore: fixed part, and per block copied.
    restore_s_fixed: float | None
    restore_s_per_block: float | None
    # Prefill of L positions: a * L + b * L^2 seconds.
    prefill_s_per_token: float | None
    prefill_s_per_token_squared: float | None
    # Context length (tokens) above which offload + restore is predicted
    # cheaper than recompute, blocks taken as L / block_size; 0 when it always
    # is; None when unknown or when recompute never costs more.
    crossover_tokens: float | None


class CostModel:
    """Predicts offload + restore and recompute seconds; fed by the engine."""

    def __init__(self, block_size: int, min_samples: int) -> None:
        self.block_size = block_size
        self.min_samples = min_samples
        self.offload = CopyFit()
        self.restore = CopyFit()
        self.step = LinearFit(5, _FORGET_STEP)  # the step model above
        self.num_prefill_steps = 0  # steps measured with a prefill chunk

    @property
    def num_offloads(self) -> int:
        return self.offload.num_samples

    @property
    def num_restores(self) -> int:
        return self.restore.num_samples

    def observe_offload(self, num_blocks: int, seconds: float) -> None:
        self.offload.add(num_blocks, seconds)

    def observe_restore(self, num_blocks: int, seconds: float) -> None:
        self.restore.add(num_blocks, seconds)

    def observe_step(self, seqs: Sequence[ScheduledSeq], num_decodes: int, seconds: float) -> None:
        """A step ran `seqs` (its first `num_decodes` are decodes) in `seconds`."""
        features = step_features(seqs, num_decodes)
        self.step.add(features, seconds, self.num_prefill_steps >= self.min_samples)
        if features[3]:  # prefill tokens
            self.num_prefill_steps += 1

    def offload_restore_s(self, num_blocks: int) -> float | None:
        """Predicted seconds to offload `num_blocks` and restore them later."""
        if min(self.num_offloads, self.num_restores) < self.min_samples:
            return None
        return _positive(self.offload.predict(num_blocks) + self.restore.predict(num_blocks))

    def restore_s(self, num_blocks: int) -> float | None:
        """Predicted seconds to read `num_blocks` from the cache into blocks."""
        if self.num_restores < self.min_samples:
            return None
        return _positive(self.restore.predict(num_blocks))

    def prefill_s(self, start: int, end: int) -> float | None:
        """Predicted seconds to prefill positions [start, end) after [0, start)."""
        if self.num_prefill_steps < self.min_samples:
            return None
        a, b = self.step.theta[3:]
        return _positive(a * (end - start) + b * (end * end - start * start))

    def recompute_s(self, num_tokens: int) -> float | None:
        """Predicted seconds to prefill positions [0, num_tokens) again."""
        if self.num_prefill_steps < self.min_samples:
            return None
        return _positive(self.step.predict((0.0, 0.0, 0.0, num_tokens, num_tokens**2)))

    def estimates(self) -> CostEstimates:
        copies = min(self.num_offloads, self.num_restores) >= self.min_samples
        prefill = self.num_prefill_steps >= self.min_samples
        u_off, v_off = self.offload.theta
        u_res, v_res = self.restore.theta
        a, b = self.step.theta[3:]
        crossover = (_crossover(u_off + u_res, (v_off + v_res) / self.block_size, a, b)
                     if copies and prefill else None)
        return CostEstimates(
            _known(u_off, copies), _known(v_off, copies), _known(u_res, copies),
            _known(v_res, copies), _known(a, prefill), _known(b, prefill), crossover)


def _known(value: float, trusted: bool) -> float | None:
    return value if trusted else None


def _positive(seconds: float) -> float | None:
    return seconds if seconds > 0 else None


def _crossover(fixed: float, per_token: float, a: float, b: float) -> float | None:
    """The largest L where a * L + b * L^2 = fixed + per_token * L; above it
    recompute costs more. None unless b > 0 (else it need never cost more)."""
    if b <= 0:
        return None
    linear = a - per_token
    discriminant = linear * linear + 4 * b * fixed
    if discriminant < 0:  # recompute costs more at every length
        return 0.0
    return max(0.0, (-linear + math.sqrt(discriminant)) / (2 * b))
