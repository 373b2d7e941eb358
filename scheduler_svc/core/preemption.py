"""Preemption policy: which decodes give up their blocks, how, and who comes back.

    victims   when the running decodes need more new blocks than are
              allocatable (counting as soon free the blocks of offloads in
              flight, of any copy an aborted request left, and of decodes
              sampling their last token in the blocks they hold, which are
              never victims): shortest output first, then longest prompt;
              one decode always keeps running. A prefill is never a victim (admission
              gave it all its blocks).
    how       OFFLOAD: always offload. RECOMPUTE: always drop the KV.
              AUTO: recompute while the cache service is down; else offload
              unless recomputing is predicted cheaper than offload + restore
              (costs.py; offload until both are measured). Recomputing
              skips the victim's leading cached blocks something that
              outlives the round holds too (a request that keeps running, a
              prefix-tier save; not another victim, a copy about to land, a
              decode about to finish): its readmission finds them. Every
              REMEASURE_EVERY-th victim in a row it would recompute so is
              offloaded instead: copy estimates are updated only by copies,
              and the first of a process (which allocate pinned buffers) can
              be far slower than the rest. The cache's own
              admission is the only capacity check (a refused put falls back
              to recompute when it lands).
    resume    OFFLOADED requests, oldest arrival first, while free blocks
              cover the snapshot plus headroom for the running decodes (their
              reservation and `resume_headroom` blocks each) and seats last.

Policy only: every status change goes through `Lifecycle`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from itertools import chain

from scheduler_svc.core.config import PreemptionMode, SchedulerConfig
from scheduler_svc.core.costs import CostModel
from scheduler_svc.core.lifecycle import Lifecycle
from scheduler_svc.core.outputs import OffloadCommand, Preempted, PreemptReason, RestoreCommand
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.reservation import Reservation

# AUTO: at most this many victims in a row recomputed because copies were
# predicted dearer; the next is offloaded, to measure copies again (bounding
# what stale estimates cost: one victim's copies in this many).
REMEASURE_EVERY = 32


class Preemption:
    def __init__(
        self, config: SchedulerConfig, life: Lifecycle, reservation: Reservation
    ) -> None:
        self.config = config
        self.life = life
        self.reservation = reservation
        # The cache service answered its latest probe (the engine reports it).
        self.cache_available = False
        # What offload + restore and recompute cost (the engine measures).
        self.costs = CostModel(config.block_size, config.min_cost_samples)
        self._recomputed_in_a_row = 0  # AUTO: victims recomputed as cheaper since an offload

    def preempt_for_decodes(self, num_saving: Callable[[], int] | None = None
                            ) -> tuple[list[Preempted], list[OffloadCommand]]:
        """Preempts decodes until every other one can get its next block, counting
        the blocks copies in flight will free (offloads', aborted requests',
        and `num_saving()` held only by prefix-tier saves, asked only when
        blocks run short).
        Returns the victims' choices (they are now OFFLOADING or WAITING) and
        the copies to make."""
        life = self.life
        kv = life.kv
        pool = kv.pool
        decoding = life.decoding
        victims: list[Preempted] = []
        offloads: list[OffloadCommand] = []
        if pool.num_allocatable_blocks >= len(decoding):
            return victims, offloads
        block_size = self.config.block_size
        num_needed = sum(
            1 for r in decoding.values() if r.num_computed_tokens >= len(r.block_ids) * block_size
        )
        # Decodes sampling their last token (max_tokens) this step in the
        # blocks they hold free them after it: preempted, one would redo its
        # whole context to spare the others a step's wait.
        finishing = [r for r in decoding.values() if r.num_remaining_tokens == 1
                     and r.num_computed_tokens < len(r.block_ids) * block_size]
        num_soon_free = (0 if num_saving is None else num_saving()) + sum(
            kv.num_exclusive_blocks(r) for r in chain(self._freed_on_landing(), finishing))
        if num_needed <= pool.num_allocatable_blocks + num_soon_free:
            return victims, offloads
        by_progress = sorted(
            (r for r in decoding.values() if r not in finishing),
            key=lambda r: (len(r.output_token_ids), -r.num_prompt_tokens)
        )
        # The victims first, then how each goes: a block it shares counts as
        # kept only if something that outlives this round holds it too.
        chosen: list[Request] = []
        let_go: Counter[int] = Counter()  # block id: references the victims drop
        for victim in by_progress[:-1]:
            if num_needed <= pool.num_allocatable_blocks + num_soon_free:
                break
            if victim.num_computed_tokens >= len(victim.block_ids) * block_size:
                num_needed -= 1
            chosen.append(victim)
            let_go.update(victim.block_ids)
            num_soon_free += sum(1 for b in victim.block_ids if let_go[b] == pool.ref_cnt(b))
        for held in chain(self._freed_on_landing(), finishing):
            let_go.update(held.block_ids)
        kept = [self._num_kept_tokens(victim, let_go) for victim in chosen]
        for victim, num_kept_tokens in zip(chosen, kept, strict=True):
            victim.num_preemptions += 1
            choice = self.choose(victim.request_id, victim.num_computed_tokens, num_kept_tokens)
            victims.append(choice)
            if choice.mode is PreemptionMode.OFFLOAD:
                offloads.append(life.start_offload(victim))
            else:
                life.recompute(victim)
        if victims:
            self.reservation.on_preemption(decoding.values())
        return victims, offloads

    def _freed_on_landing(self) -> Iterator[Request]:
        """Requests whose copy in flight frees their blocks when it lands:
        offloads, and every copy or load of an aborted request."""
        life = self.life
        yield from life.offloading.values()
        for req in chain(life.copies.values(), life.loads.values()):
            if req.status is RequestStatus.FINISHED_ABORTED:
                yield req

    def _num_kept_tokens(self, req: Request, let_go: Counter[int]) -> int:
        """Positions of req's KV its preemption leaves in the prefix cache for
        sure: its leading cached blocks that something else holds too, beyond
        the `let_go` references (this round's victims', copies' landing,
        finishing decodes'): freed, those blocks may be evicted."""
        pool = self.life.kv.pool
        num_kept = 0
        for block_id in req.block_ids:
            if pool.ref_cnt(block_id) <= let_go[block_id] or pool.block_hash(block_id) is None:
                break
            num_kept += 1
        # Less one: a prediction of 0 s would read as none (costs._positive).
        return min(num_kept * self.config.block_size, req.num_computed_tokens - 1)

    def choose(self, request_id: str, num_tokens: int, num_kept_tokens: int = 0) -> Preempted:
        """Offload or recompute a victim holding KV of `num_tokens` positions,
        the first `num_kept_tokens` of which a recompute finds cached."""
        num_blocks = self.life.kv.num_blocks_for(num_tokens)
        offload_restore_s = self.costs.offload_restore_s(num_blocks)
        recompute_s = self.costs.prefill_s(num_kept_tokens, num_tokens)
        mode = self.config.preemption_mode
        if mode is not PreemptionMode.AUTO:
            reason = PreemptReason.FORCED
        elif not self.cache_available:
            mode, reason = PreemptionMode.RECOMPUTE, PreemptReason.CACHE_UNAVAILABLE
        elif offload_restore_s is None or recompute_s is None:
            mode, reason = PreemptionMode.OFFLOAD, PreemptReason.NO_ESTIMATE
        elif offload_restore_s < recompute_s:
            mode, reason = PreemptionMode.OFFLOAD, PreemptReason.CHEAPER
        elif self._recomputed_in_a_row + 1 < REMEASURE_EVERY:
            self._recomputed_in_a_row += 1
            mode, reason = PreemptionMode.RECOMPUTE, PreemptReason.CHEAPER
        else:
            mode, reason = PreemptionMode.OFFLOAD, PreemptReason.REMEASURE
        if mode is PreemptionMode.OFFLOAD:
            self._recomputed_in_a_row = 0
        return Preempted(request_id, mode, reason, num_tokens, num_blocks, offload_restore_s,
                         recompute_s)

    def resume(self, num_seats: int, kept_back: int) -> list[RestoreCommand]:
        """Restores OFFLOADED requests, oldest first, while blocks and seats
        last, keeping back what admission does (`kept_back`: the reservations
        of the requests about to decode, Admission.blocks_kept_back; and each
        resumed request's own) plus resume_headroom blocks per running decode."""
        life = self.life
        pool = life.kv.pool
        offloaded = life.offloaded
        reservation = self.reservation
        headroom_per_decode = self.config.resume_headroom
        headroom = kept_back + headroom_per_decode * len(life.decoding)
        commands: list[RestoreCommand] = []
        while offloaded and len(commands) < num_seats:
            req = offloaded[0]
            snapshot = req.snapshot
            assert snapshot is not None
            # It decodes as soon as its KV lands: its own reservation too.
            own = reservation.own_blocks(req, snapshot.num_blocks)
            if pool.num_allocatable_blocks < snapshot.num_blocks + headroom + own:
                break
            command = life.start_restore(req)
            assert command is not None  # the pool covers the snapshot
            commands.append(command)
            headroom += own + headroom_per_decode
        return commands
