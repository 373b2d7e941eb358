"""Admission-time checks: a request that can never fit is refused here, with a clear error.

Anything that passes can always be scheduled eventually (alone, with the whole
pool), so no request ever fails later because memory ran short.
"""

from __future__ import annotations

from kvstash.errors import InvalidArgument
from kvstash.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig


def check_new_request(
    config: SchedulerConfig, request_id: str, prompt: tuple[int, ...], sampling: SamplingParams
) -> None:
    """Raises InvalidArgument naming the bad value; returns None when the request fits.
    (Sampling values were checked when `sampling` was built.)"""
    if not prompt:
        raise InvalidArgument(f"request {request_id}: prompt is empty")
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
