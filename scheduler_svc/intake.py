"""Admission-time checks: a request that can never fit is refused here, with a clear error.

Anything that passes can always be scheduled eventually (alone, with the whole
pool), so no request ever fails later because memory ran short.
"""

from __future__ import annotations

import math

from kvstash.errors import InvalidArgument
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.request import SamplingParams


def check_new_request(
    config: SchedulerConfig, request_id: str, prompt: tuple[int, ...], sampling: SamplingParams
) -> None:
    """Raises InvalidArgument naming the bad value; returns None when the request fits."""
    if not prompt:
        raise InvalidArgument(f"request {request_id}: prompt is empty")
    if sampling.max_tokens <= 0:
        raise InvalidArgument(
            f"request {request_id}: max_tokens must be positive, got {sampling.max_tokens}"
        )
    temperature_ok = math.isfinite(sampling.temperature) and sampling.temperature >= 0
    if not temperature_ok or not 0 < sampling.top_p <= 1 or sampling.top_k < 0:
        raise InvalidArgument(
            f"request {request_id}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
            f"{sampling.temperature}, {sampling.top_p}, {sampling.top_k}"
        )
    vocab_size = config.vocab_size
    for pos, token_id in enumerate(prompt):
        if not (isinstance(token_id, int) and 0 <= token_id < vocab_size):
            raise InvalidArgument(
                f"request {request_id}: token id {token_id!r} at position {pos} is outside "
                f"the vocabulary [0, {vocab_size})"
            )
    num_total = len(prompt) + sampling.max_tokens
    if num_total > config.max_model_len:
        raise InvalidArgument(
            f"request {request_id}: prompt of {len(prompt)} tokens + max_tokens "
            f"{sampling.max_tokens} = {num_total} exceeds max_model_len {config.max_model_len}"
        )
    num_blocks = -(-num_total // config.block_size)
    if num_blocks > config.num_blocks:
        raise InvalidArgument(
            f"request {request_id}: {num_total} tokens need {num_blocks} blocks, the whole "
            f"pool has {config.num_blocks} ({config.num_blocks * config.block_size} tokens)"
        )
