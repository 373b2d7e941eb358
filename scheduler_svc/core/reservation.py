"""Admission control: blocks kept back for the growth of running decodes.

    reserved_tokens(req) = min(max_tokens - len(output), clip_max_new_tokens) * new_token_ratio
    reserved_blocks(req) = ceil(reserved_tokens(req) / block_size), at most the
                           blocks it can still use (prompt + max_tokens - 1
                           positions in all, less the blocks it holds)

new_token_ratio starts at init, drops by (init - min) / decay_steps every step
(min = init * min_new_token_ratio_factor), goes back to init when the
scheduler is idle, and after a preemption is re-estimated from real progress:

    ratio = (sum(len(output)) + retract_steps * num_decode) / (sum(max_tokens) + 1)

capped at init, over the decode requests still running. Under the
FIXED_BLOCKS policy every decode request reserves fixed_blocks_per_decode
blocks instead; the ratio is still tracked (and reported) either way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from scheduler_svc.core.config import ReservationPolicy, SchedulerConfig
from scheduler_svc.core.request import Request


class Reservation:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.init_ratio = config.init_new_token_ratio
        self.min_ratio = config.min_new_token_ratio
        self.decay = config.new_token_ratio_decay
        self.new_token_ratio = self.init_ratio

    def on_step(self, idle: bool) -> None:
        """Called once per scheduling step, before any preemption."""
        if idle:
            self.new_token_ratio = self.init_ratio
        else:
            self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - self.decay)

    def on_preemption(self, decoding: Iterable[Request]) -> None:
        """Re-estimates the ratio from the decode requests that keep running."""
        num_decoded = 0
        num_max_tokens = 0
        num_decode = 0
        for req in decoding:
            num_decoded += len(req.output_token_ids)
            num_max_tokens += req.sampling.max_tokens
            num_decode += 1
        ratio = (num_decoded + self.config.retract_steps * num_decode) / (num_max_tokens + 1)
        self.new_token_ratio = min(ratio, self.init_ratio)

    def reserved_blocks(self, req: Request, num_held: int | None = None) -> int:
        """Under the ratio never more than it can still use (_usable; `num_held`
        defaults to its block table's length); fixed_blocks: N for any decode."""
        config = self.config
        if config.reservation_policy is ReservationPolicy.FIXED_BLOCKS:
            return config.fixed_blocks_per_decode
        return _blocks(req, len(req.block_ids) if num_held is None else num_held,
                       config.block_size, config.clip_max_new_tokens, self.new_token_ratio)

    def own_blocks(self, req: Request, num_held: int) -> int:
        """What a request about to decode keeps back for itself as it takes
        `num_held` blocks (admitted, or resuming): its reservation, never more
        than it can use (fixed_blocks reserves N for any decode, so a request
        that fits the pool alone would otherwise be refused)."""
        reserved = self.reserved_blocks(req, num_held)
        if self.config.reservation_policy is ReservationPolicy.FIXED_BLOCKS:
            return min(reserved, max(_usable(req, num_held, self.config.block_size), 0))
        return reserved  # the ratio's is capped already

    def total_reserved_blocks(self, reqs: Iterable[Request]) -> int:
        """`reserved_blocks` summed (admission sums it over every running
        decode on every step a request waits: one call per request, not three)."""
        config = self.config
        if config.reservation_policy is ReservationPolicy.FIXED_BLOCKS:
            return config.fixed_blocks_per_decode * sum(1 for _ in reqs)
        args = config.block_size, config.clip_max_new_tokens, self.new_token_ratio
        return sum([_blocks(req, len(req.block_ids), *args) for req in reqs])


def _blocks(req: Request, num_held: int, block_size: int, clip: int, ratio: float) -> int:
    """reserved_blocks under the ratio (module docstring)."""
    max_tokens = req.sampling.max_tokens
    remaining = min(max_tokens - len(req.output_token_ids), clip)
    wanted = math.ceil((remaining if remaining > 0 else 0) * ratio / block_size)
    return max(0, min(wanted, _usable(req, num_held, block_size)))


def _usable(req: Request, num_held: int, block_size: int) -> int:
    """Blocks it can still use: for prompt + max_tokens - 1 positions in all
    (its last token needs no KV), less the `num_held` it holds."""
    return -(-(req.num_prompt_tokens + req.sampling.max_tokens - 1) // block_size) - num_held
