"""Prefill: chunks of running prefills, then admissions from WAITING.

    budget   max_num_batched_tokens, minus one token per decode this step
    chunks   running prefills first, in admission order; a long prompt (or a
             recomputed prompt + output) takes as many steps as its tokens
             need under the budget
    admit    WAITING requests from the front while the budget, seats
             (max_num_seqs) and blocks last; each takes every block of its
             prefill at once (a prefix-cache hit shares the cached blocks),
             keeping back the reservation of the requests about to decode,
             its own too where its prompt loads or fits one chunk:

               reserved = reserved_blocks(running decodes)
                        + reserved_blocks(prefills whose next chunk is their last)
                        + reserved_blocks(requests resuming or loading)
                        + reserved_blocks(requests RESERVED for a prefill instance)

A P/D decode instance accepts a reservation under the same rule
(`PdManager.reserve`, pd.py): its prompt's blocks, keeping back the above plus its
own reserved_blocks.

A request admitted this way never needs another block before it decodes, so
a prefill is never a preemption victim. With a prefix tier (prefix_tier.py),
an admitted request whose prompt the tier holds beyond the local prefix cache
takes its blocks the same way, then waits LOADING for those segments instead
of computing a chunk this step.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.lifecycle import RUNNING_PREFILL, Lifecycle
from scheduler_svc.core.outputs import PrefixLoad, ScheduledSeq
from scheduler_svc.core.prefix_tier import PrefixTier
from scheduler_svc.core.request import Request
from scheduler_svc.core.reservation import Reservation


class Admission:
    def __init__(
        self, config: SchedulerConfig, life: Lifecycle, reservation: Reservation,
        clock: Callable[[], float], tier: PrefixTier | None,
    ) -> None:
        self.config = config
        self.life = life
        self.reservation = reservation
        self._clock = clock
        self._tier = tier

    def schedule_prefills(
        self, budget: int, seqs: list[ScheduledSeq], admit: bool, loads: list[PrefixLoad]
    ) -> tuple[list[Request], int]:
        """Appends prefill chunks to `seqs` (running prefills, then admissions
        if `admit`) and prefix-tier loads of admitted requests to `loads`;
        returns the requests scheduled, in order, and the budget left."""
        scheduled: list[Request] = []
        for req in self.life.prefilling.values():
            if budget == 0:
                break
            budget -= self._chunk(req, budget, seqs)
            scheduled.append(req)
        if admit and budget:
            budget = self._admit(budget, seqs, scheduled, loads)
        return scheduled, budget

    def blocks_kept_back(self) -> int:
        """The reservations of the requests about to decode (module docstring)."""
        life = self.life
        total = self.reservation.total_reserved_blocks
        chunk_limit = self.config.max_num_batched_tokens
        # A prefill whose next chunk completes its prompt is about to decode,
        # and a resuming or reserved request as soon as its KV lands.
        return (
            total(life.decoding.values())
            + total(r for r in life.prefilling.values()
                    if r.num_tokens - r.num_computed_tokens <= chunk_limit)
            + total(life.resuming.values())
            + total(life.loading.values())
            + total(life.reserved.values())
        )

    def _chunk(self, req: Request, budget: int, seqs: list[ScheduledSeq]) -> int:
        start = req.num_computed_tokens
        end = min(req.num_tokens, start + budget)
        seqs.append(ScheduledSeq(
            req.request_id, req.token_ids(start, end), start, req.block_ids,
            end == req.num_tokens, req.sampling,
        ))
        return end - start

    def _admit(self, budget: int, seqs: list[ScheduledSeq], scheduled: list[Request],
               loads: list[PrefixLoad]) -> int:
        life = self.life
        waiting = life.waiting
        if not waiting:
            return budget
        config = self.config
        kv = life.kv
        own_blocks = self.reservation.own_blocks
        chunk_limit = config.max_num_batched_tokens
        reserved = self.blocks_kept_back()
        tier = self._tier
        num_running = life.num_running
        while waiting and budget > 0 and num_running < config.max_num_seqs:
            req = waiting[0]
            prefix_block_ids = kv.find_prefix(req)
            plan = None if tier is None else tier.plan_load(req, len(prefix_block_ids))
            declined = plan is not None and plan.declined
            if declined:
                plan = None
            if plan is not None:  # the local prefix up to the first segment loaded
                del prefix_block_ids[plan.num_local_blocks:]
            num_new_tokens = req.num_tokens - len(prefix_block_ids) * config.block_size
            # About to decode (its prompt loads or fits one chunk): its own
            # reservation is kept back too, or its first decode could find no
            # block and preempt it, or another, the step after admission.
            own = 0
            if plan is not None or num_new_tokens <= chunk_limit:
                own = own_blocks(req, kv.num_blocks_for(req.num_tokens))
            if kv.allocate_slots(req, num_new_tokens, prefix_block_ids, reserved + own) is None:
                break
            reserved += own
            if declined:
                life.counters.num_tier_loads_declined += 1
            num_hit_tokens = len(prefix_block_ids) * config.block_size
            life.counters.num_prefix_query_tokens += req.num_tokens
            life.counters.num_prefix_hit_tokens += num_hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self._clock()
                req.num_cached_tokens = num_hit_tokens
            num_running += 1
            if plan is not None:
                assert tier is not None
                loads.append(tier.load(req, plan, life.start_load(req)))
                continue
            life.move(req, RUNNING_PREFILL)
            budget -= self._chunk(req, budget, seqs)
            scheduled.append(req)
        return budget
