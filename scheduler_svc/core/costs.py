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

The step fit is least squares of the relative error over the last 64 steps
with prefill chunks and the last 64 without, no coefficient below 0, each
step's seconds bounded by the fit, re-solved every 16 steps (step_fit.py).
A fit is trusted once `min_samples` of its samples were measured (for the
steps: steps with prefill chunks). A prediction of zero or less counts as
none.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from scheduler_svc.core.copy_fit import CopyFit
from scheduler_svc.core.seq import ScheduledSeq
from scheduler_svc.core.step_fit import StepFit

_START_POS = operator.attrgetter("start_pos")


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
        self.step = StepFit()  # the step model above
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
        prefill = features[3] > 0  # prefill tokens
        self.step.add(features, seconds, prefill)
        if prefill:
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
