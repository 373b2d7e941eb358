"""A copy's seconds as a line in the blocks it copies, robust to outliers."""

from __future__ import annotations

from collections import deque
from itertools import combinations
from statistics import median

# A copy fit's memory: its last this many copies.
_COPY_WINDOW = 32


class CopyFit:
    """seconds ~ fixed + per_block * blocks over the last _COPY_WINDOW copies,
    by medians (Theil-Sen): per_block is the median slope between two copies
    of different sizes (with none, of each copy's line through 0), fixed the
    median of what each copy took beyond per_block * blocks; neither below 0.
    A copy far off the rest (a process's first, which allocates pinned
    buffers; one that waited for a busy machine) moves neither median much
    and is gone _COPY_WINDOW copies later. Least squares over forgotten
    copies let one copy 100x slow among the first four give large copies a
    negative cost for 100-300 copies."""

    __slots__ = ("_samples", "_theta", "num_samples")

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=_COPY_WINDOW)
        self._theta: list[float] | None = None  # solved lazily; None: stale
        self.num_samples = 0

    def add(self, num_blocks: int, seconds: float) -> None:
        self._samples.append((num_blocks, seconds))
        self._theta = None
        self.num_samples += 1

    @property
    def theta(self) -> list[float]:
        """[fixed seconds, seconds per block]; zeros before any copy."""
        if self._theta is None:
            samples = self._samples
            slopes = [(y2 - y1) / (n2 - n1)
                      for (n1, y1), (n2, y2) in combinations(samples, 2) if n1 != n2]
            if not slopes:
                slopes = [y / n for n, y in samples if n > 0]
            per_block = max(0.0, median(slopes)) if slopes else 0.0
            fixed = max(0.0, median(y - per_block * n for n, y in samples)) if samples else 0.0
            self._theta = [fixed, per_block]
        return self._theta

    def predict(self, num_blocks: int) -> float:
        fixed, per_block = self.theta
        return fixed + per_block * num_blocks
