"""How one request's tokens are chosen: the sampling domain type every service shares.

The scheduler reads `max_tokens`, `stop_token_ids` and `ignore_eos` (when a
request finishes); the worker reads `temperature`, `top_k`, `top_p` and
`seed` (how a token is drawn). Protos convert to and from it only in
`kvstash.common.wire`. Construction validates every value, so a bad setting is an
InvalidArgument that names it, wherever it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstash.errors import InvalidArgument

MAX_SEED = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    # Most output tokens to generate (>= 1).
    max_tokens: int
    # 0 = greedy.
    temperature: float = 0.0
    # Nucleus mass in (0, 1]; 1.0 = off.
    top_p: float = 1.0
    # 0 = off.
    top_k: int = 0
    # Seed of the request's own draws, in [0, 2**64); None = unseeded.
    seed: int | None = None
    # Tokens that finish the request (the token is kept in the output).
    stop_token_ids: tuple[int, ...] = ()
    # Keep going past EOS (stop_token_ids still apply).
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be positive, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgument(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgument(f"seed must be in [0, 2**64), got {self.seed}")
        stop = tuple(self.stop_token_ids)
        if any(t < 0 for t in stop):
            raise InvalidArgument(f"stop_token_ids must be >= 0, got {list(stop)[:8]}")
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# What a step uses for a chunk that samples nothing.
GREEDY = SamplingParams(max_tokens=1)
