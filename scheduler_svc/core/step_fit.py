"""A step's seconds as a line in its features, robust to outliers, no cost below 0."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from itertools import combinations_with_replacement
from statistics import median

# The fit's memory: the last this many steps with prefill chunks, and as many
# without (decode-only steps, most of a serving process's, would otherwise
# push the few that teach the prefill rates out).
_STEP_WINDOW = 64
# A step further off the fit than this many robust scales (1.4826 x the median
# relative residual: the standard deviation, were the noise normal) counts as
# only this far off, also before the fit is trusted.
_CLIP = 3.0
# Clip-and-refit rounds at most: each starts from the fit the last one left,
# and the last is the one that moved no step's fit by _SETTLED of its scale.
_ROUNDS = 8
_SETTLED = 1e-6
# A fit asked for is re-solved once this many steps were added since its last
# solve: a solve (about 0.6 ms in CPython) costs what 400 adds do, and admission
# may ask every step (a waiting request's prefix-tier load against prefilling).
_RESOLVE_EVERY = 16
# What a step's seconds are fitted to (costs.step_features).
_NUM_FEATURES = 5
# Added to the diagonal of the scaled normal equations: a direction no sample
# has told apart (two features always in proportion) gets the least-norm answer.
_RIDGE = 1e-9


class StepFit:
    """seconds ~ theta . features over the last _STEP_WINDOW steps of each
    kind, by least squares of the error relative to the larger of a step's
    seconds and the fit's (a 10 ms step weighs as much as a 300 ms one, one
    100x slow 1/10,000 of its neighbours, one 10x fast as its neighbours)
    with no coefficient below 0 (`nnls`), each step's seconds bounded by the
    fit (`_CLIP`) and refitted until none moves; re-solved every
    _RESOLVE_EVERY steps, from the last fit. A step far slower than the rest
    (a process's first, which allocate and fault pages in; one that waited
    for a busy CPU) or faster (a clock misread) moves the fit little, trusted
    or not, and is gone a window later. Least squares over exponentially
    forgotten steps, clipped only once trusted, let one step 100x slow among
    the first four give the prefill tokens a negative cost (recompute_s 200x
    too high) for about 1,000 steps; weighed by its own seconds alone, one
    step 10x fast put recompute_s 70% off for a window."""

    __slots__ = ("_num_stale", "_others", "_prefills", "_theta", "num_samples")

    def __init__(self) -> None:
        self._prefills: deque[tuple[Sequence[float], float]] = deque(maxlen=_STEP_WINDOW)
        self._others: deque[tuple[Sequence[float], float]] = deque(maxlen=_STEP_WINDOW)
        self._theta: list[float] | None = None  # solved lazily; None: never
        self._num_stale = 0  # steps added since it was
        self.num_samples = 0

    def add(self, features: Sequence[float], seconds: float, prefill: bool) -> None:
        """One step's features and seconds; `prefill`: it ran prefill chunks."""
        (self._prefills if prefill else self._others).append((features, seconds))
        self._num_stale += 1
        self.num_samples += 1

    @property
    def theta(self) -> list[float]:
        """Seconds per unit of each feature; zeros before any step."""
        if self._theta is None or self._num_stale >= _RESOLVE_EVERY:
            self._num_stale = 0
            self._theta = self._solve()
        return self._theta

    def _solve(self) -> list[float]:
        steps = [(x, y) for x, y in (*self._others, *self._prefills) if y > 0]
        if not steps:
            return [0.0] * _NUM_FEATURES
        seconds = [y for _, y in steps]
        # Each step's error is relative to its scale: its seconds, or the last
        # fit's where that is more, so a step far faster than the fit says
        # (one 10x fast weighed 100x its neighbours) weighs as it should have.
        previous = self._theta
        scales = seconds if previous is None else [
            max(y, _dot(previous, x)) for x, y in steps]
        targets = seconds
        fits: list[float] | None = None
        theta = [0.0] * _NUM_FEATURES
        for _ in range(_ROUNDS):
            # Each step's row divided by its scale: theta . row is the fit's
            # seconds over the scale, to match its (clipped) seconds over it.
            rows = [[xi / s for xi in x] for (x, _), s in zip(steps, scales, strict=True)]
            theta = nnls(*normal_equations(
                rows, [t / s for t, s in zip(targets, scales, strict=True)]))
            refits = [_dot(theta, x) for x, _ in steps]
            if fits is not None and max(abs(a - b) / s for a, b, s in zip(
                    refits, fits, scales, strict=True)) < _SETTLED:
                break
            fits = refits
            errors = [abs(y / p - 1) for y, p in zip(seconds, fits, strict=True) if p > 0]
            bound = _CLIP * 1.4826 * median(errors) if errors else 0.0
            # Measured seconds clipped into p * [1 - bound, 1 + bound] around the fit's p.
            targets = [min(max(y, p * (1 - bound)), p * (1 + bound)) if p > 0 else y
                       for y, p in zip(seconds, fits, strict=True)]
            scales = [max(y, p) for y, p in zip(seconds, fits, strict=True)]
        return theta

    def predict(self, features: Sequence[float]) -> float:
        return _dot(self.theta, features)


def normal_equations(rows: Sequence[Sequence[float]], targets: Sequence[float]
                     ) -> tuple[list[float], list[float]]:
    """X^T X (its upper triangle, row after row) and X^T y for the rows of X
    and the targets y; features that are 0 add nothing."""
    n = len(rows[0])
    upper = [0.0] * (n * (n + 1) // 2)
    moment = [0.0] * n
    for x, y in zip(rows, targets, strict=True):
        row = 0  # where feature i's row of the upper triangle starts
        for i in range(n):
            xi = x[i]
            if xi:
                moment[i] += xi * y
                for j in range(i, n):
                    xj = x[j]
                    if xj:
                        upper[row + j - i] += xi * xj
            row += n - i
    return upper, moment


def nnls(upper: list[float], moment: list[float]) -> list[float]:
    """theta >= 0 that minimises |X theta - y|^2, given X^T X (`upper`: its
    upper triangle, row after row) and X^T y: Lawson and Hanson's active set,
    on equations scaled to a unit diagonal first (the features differ by many
    orders of magnitude); features never seen get 0."""
    n = len(moment)
    gram = [[0.0] * n for _ in range(n)]
    for value, (i, j) in zip(upper, combinations_with_replacement(range(n), 2), strict=True):
        gram[i][j] = gram[j][i] = value
    seen = [i for i in range(n) if gram[i][i] > 0]
    scale = [1 / math.sqrt(gram[i][i]) for i in seen]
    size = len(seen)
    g = [[gram[i][j] * scale[a] * scale[b] + (_RIDGE if a == b else 0.0)
          for b, j in enumerate(seen)] for a, i in enumerate(seen)]
    m = [moment[i] * scale[a] for a, i in enumerate(seen)]
    tolerance = 1e-12 * max((abs(v) for v in m), default=0.0)
    x = _solve_free(g, m, [True] * size)
    if all(v > 0 for v in x):  # nothing to hold at 0: the answer is least squares
        return _unscale(x, seen, scale, n)
    x = [0.0] * size
    free = [False] * size  # the passive set: coefficients not held at 0
    for _ in range(3 * size):  # each round frees one; Lawson and Hanson need fewer
        gradient = [m[a] - _dot(g[a], x) for a in range(size)]
        candidates = [a for a in range(size) if not free[a] and gradient[a] > tolerance]
        if not candidates:
            break
        free[max(candidates, key=gradient.__getitem__)] = True
        while True:
            z = _solve_free(g, m, free)
            if all(z[a] > 0 for a in range(size) if free[a]):
                x = z
                break
            # Step towards z until the first free coefficient reaches 0; hold it there.
            step, first = min((x[a] / (x[a] - z[a]), a) for a in range(size)
                              if free[a] and z[a] <= 0)
            x = [v + step * (w - v) for v, w in zip(x, z, strict=True)]
            x[first] = 0.0
            for a in range(size):
                if free[a] and x[a] <= 0:
                    free[a], x[a] = False, 0.0
    return _unscale(x, seen, scale, n)


def _unscale(x: list[float], seen: list[int], scale: list[float], n: int) -> list[float]:
    theta = [0.0] * n
    for a, i in enumerate(seen):
        theta[i] = x[a] * scale[a]
    return theta


def _solve_free(g: list[list[float]], m: list[float], free: list[bool]) -> list[float]:
    """The least squares answer over the free coefficients, the rest 0."""
    idx = [a for a, f in enumerate(free) if f]
    rows = [[g[a][b] for b in idx] + [m[a]] for a in idx]
    size = len(rows)
    for col in range(size):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        head = rows[col]
        for r in range(size):
            if r != col and (factor := rows[r][col] / head[col]):
                rows[r] = [v - factor * h for v, h in zip(rows[r], head, strict=True)]
    z = [0.0] * len(free)
    for k, a in enumerate(idx):
        z[a] = rows[k][size] / rows[k][k]
    return z


def _dot(theta: Sequence[float], x: Sequence[float]) -> float:
    total = 0.0
    for t, xi in zip(theta, x, strict=True):
        total += t * xi
    return total
