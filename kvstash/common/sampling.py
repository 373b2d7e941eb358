"""How one request's tokens are chosen: the sampling domain type every service shares.

The scheduler reads `max_tokens`, `stop_token_ids` and `ignore_eos` (when a
request finishes); the worker reads `temperature`, `top_k`, `top_p` and
`seed` (how a token is drawn). Protos convert to and from it only in
`kvstash.common.wire`. Construction validates every value, so a bad setting is an
InvalidArgument that names it, wherever it came from. `Room` holds the one
rule for max_tokens that both of the scheduler's APIs apply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstash.errors import InvalidArgument

MAX_SEED = (1 << 64) - 1
# Most stop token ids one request may give: every step's plan carries them to
# the worker, so a request must not make a step's message huge.
MAX_STOP_TOKEN_IDS = 256
# What a request that leaves temperature unset samples at, on both APIs:
# OpenAI's and vLLM's default (an OpenAI client through a gateway sends none).
DEFAULT_TEMPERATURE = 1.0
# Temperatures below this are greedy, as in vLLM (its _SAMPLING_EPS): dividing
# logits by a subnormal one overflows them to inf, and the draw to token 0.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    # Most output tokens to generate (>= 1).
    max_tokens: int
    # 0 = greedy; so is anything below SAMPLING_EPS, stored as 0.
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
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgument(f"seed must be in [0, 2**64), got {self.seed}")
        stop = tuple(self.stop_token_ids)
        if len(stop) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(f"stop_token_ids has {len(stop)} ids, at most "
                                  f"{MAX_STOP_TOKEN_IDS}")
        if any(t < 0 for t in stop):
            raise InvalidArgument(f"stop_token_ids must be >= 0, got {list(stop)[:8]}")
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# What a step uses for a chunk that samples nothing.
GREEDY = SamplingParams(max_tokens=1)


@dataclass(frozen=True, slots=True)
class Room:
    """Where a request's sequence must fit, and max_tokens by one rule on
    every API (as OpenAI and vLLM's OpenAI server take it):

        |<-------------------- max_len -------------------->|
        |<-- num_prompt_tokens -->|<-- output: at most ---->|
                                       max_tokens, unset: all of it

    Unset, a request runs until the context ends (or a stop); a max_tokens
    that does not fit is refused, never cut; a prompt that leaves no room
    is refused either way."""

    num_prompt_tokens: int
    # The longest sequence (prompt + output) the instance serves: its
    # max_model_len, or fewer where its KV pool holds fewer tokens.
    max_len: int

    def max_tokens(self, requested: int | None) -> int:
        """`requested` (None: unset) as the request's max_tokens; InvalidArgument
        naming the quantities where it does not fit. 0 and below are left to
        SamplingParams, which names them."""
        room = self.max_len - self.num_prompt_tokens
        if room < 1:
            raise InvalidArgument(
                f"prompt of {self.num_prompt_tokens} tokens leaves no room to generate: "
                f"sequences here are at most {self.max_len} tokens (max_model_len, or what "
                "the KV pool holds)")
        if requested is None:
            return room
        if requested > room:
            raise InvalidArgument(
                f"max_tokens {requested} does not fit: a prompt of {self.num_prompt_tokens} "
                f"tokens leaves room for at most {room} (sequences here are at most "
                f"{self.max_len} tokens: max_model_len, or what the KV pool holds); leave "
                "max_tokens unset to generate until the context ends")
        return requested
