"""Scheduler: one step's decisions, and the bookkeeping of its results.

`schedule()`, in order:

    1. preempt   if the running decodes need more blocks than are free
                 (preemption.py: victims, offload or recompute by costs.py)
    2. decode    every RUNNING_DECODE request: one token, a block if it needs one
                 (first to those that got none last step)
    3. resume    OFFLOADED requests back into fresh blocks (preemption.py)
    4. prefill   running chunks, then admissions from WAITING (admission.py);
                 nothing new is admitted while a preempted request waits

`update()` records what the worker computed: progress, tokens, finishes.
An output never updated changes nothing but the blocks it allocated. Every
status change goes through `Lifecycle.move` (lifecycle.py).

P/D disaggregation lives in pd.py: a scheduler in a P/D role composes a
`PdManager` (`self.pd`), whose hooks schedule() and update() call; a MIXED
scheduler has none and never enters P/D code.

Why one file over 300 lines: schedule() and update() are one step's two
halves over shared bookkeeping (the requests behind the output's seqs), and
every other method is a line or two over the part that owns it: the core's
whole API in one place, so the edge holds one object and reaches no further.
Splitting would scatter the step, or hand the edge `core.x.y` chains.
The prefix tier's entry points (`prompt_block_hashes`, `finish_prefix_*`)
are such lines over prefix_tier.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from itertools import chain, islice

from kvstash.common.sampling import SamplingParams
from kvstash.common.stats import values
from kvstash.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from scheduler_svc.core.admission import Admission
from scheduler_svc.core.config import PrefixWrite, Role, SchedulerConfig
from scheduler_svc.core.costs import CostEstimates
from scheduler_svc.core.intake import Intake
from scheduler_svc.core.invariants import check_scheduler
from scheduler_svc.core.kv_events import KvEvent, KvEventLog
from scheduler_svc.core.kv_manager import ROOT_HASH, KVCacheManager, chain_hashes
from scheduler_svc.core.lifecycle import (
    FINISHED_LENGTH,
    FINISHED_STOPPED,
    RUNNING_DECODE,
    RUNNING_PREFILL,
    Lifecycle,
)
from scheduler_svc.core.outputs import (
    Counters,
    OffloadCommand,
    PrefixLoad,
    RequestUpdate,
    RestoreCommand,
    ScheduledSeq,
    SchedulerOutput,
    SchedulerStats,
)
from scheduler_svc.core.pd import PdManager
from scheduler_svc.core.preemption import Preemption
from scheduler_svc.core.prefix_tier import PrefixTier
from scheduler_svc.core.request import Request, RequestUsage
from scheduler_svc.core.reservation import Reservation


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size)
        self.reservation = Reservation(config)
        self._counters = Counters()
        self.life = Lifecycle(config, self.kv, self._counters)
        self.preemption = Preemption(config, self.life, self.reservation)
        # None without one: admission and update() never enter its code.
        self.tier = None if not config.prefix_segment_blocks else PrefixTier(
            config.prefix_segment_blocks, config.prefix_tier_salt, self.kv,
            self.preemption.costs, self._counters, clock,
            # Write-back keeps as many blocks free as one step may take.
            write_back_below=(-(-config.max_num_batched_tokens // config.block_size)
                              if config.prefix_write is PrefixWrite.BACK else 0))
        if self.tier is not None and config.prefix_write is PrefixWrite.BACK:
            self.kv.before_evicting = self.tier.before_evicting
        self.admission = Admission(config, self.life, self.reservation, clock, self.tier)
        self.intake = Intake(config, self.life.requests, clock)
        # None on a MIXED instance: every hook call below is skipped.
        self._pd = None if config.role is Role.MIXED else PdManager(
            config, self.life, self.intake, self.admission, self.preemption.costs, clock)
        self._clock = clock
        self._step_id = 0
        self._updated_step_id = 0
        # The requests behind the latest output's seqs: its decodes, then its prefills.
        self._scheduled_decodes: list[Request] = []
        self._scheduled_prefills: list[Request] = []
        self._stalled: list[Request] = []  # decodes the latest schedule() found no block for

    @property
    def pd(self) -> PdManager:
        """The P/D manager (pd.py); FailedPrecondition on a MIXED instance."""
        if self._pd is None:
            raise FailedPrecondition("this scheduler runs in role mixed: no P/D disaggregation")
        return self._pd

    def check_request(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> None:
        """What add_request checks before it changes anything: InvalidArgument,
        AlreadyExists."""
        self.intake.check(request_id, prompt_token_ids, sampling)

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
        *, handoff: bool = False, stored_segments: int | None = 0,
        block_hashes: Sequence[int] = (),
    ) -> Request:
        """A new request, WAITING. `handoff` (PREFILL instance only, else
        FailedPrecondition): a decode instance reserved blocks for it; once
        prefilled it goes there (PdManager.hand_off_once_prefilled).
        `stored_segments`: the leading segments of its prompt the prefix tier
        holds (`prefix_segment_ids`, asked of the cache; None: it did not
        answer, and is taken to hold none); `block_hashes`, the
        prompt's (`prompt_block_hashes`) where the caller has them already."""
        self.check_request(request_id, prompt_token_ids, sampling)
        pd = self.pd if handoff else None
        if pd is not None:
            pd.require(Role.PREFILL, "hands requests off")
        if len(self.life.waiting) >= self.config.max_num_waiting:
            raise ResourceExhausted(
                f"request {request_id}: the waiting queue is full ({len(self.life.waiting)} "
                f"requests, max_num_waiting {self.config.max_num_waiting}); retry later")
        req = self.intake.create(request_id, prompt_token_ids, sampling)
        if self.tier is not None:
            req.stored_segments = stored_segments or 0
            req.tier_answered = stored_segments is not None
            req.block_hashes.extend(block_hashes)
        self.life.add(req)
        if pd is not None:
            pd.hand_off_once_prefilled(req)
        return req

    def prompt_block_hashes(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prefix hashes of the prompt's whole blocks ([] without a prefix
        tier, which is what asks for them before the request exists)."""
        if self.tier is None:
            return []
        return chain_hashes(ROOT_HASH, prompt_token_ids, self.config.block_size)

    def prefix_segment_ids(self, block_hashes: Sequence[int]) -> list[str]:
        """The prefix-tier ids of the whole segments of a prompt with these
        block hashes, in order ([] without a tier)."""
        return [] if self.tier is None else self.tier.segment_ids(block_hashes)

    def get_request(self, request_id: str) -> Request | None:
        return self.life.requests.get(request_id)

    # --------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        config = self.config
        life = self.life
        self._step_id += 1
        out = SchedulerOutput(step_id=self._step_id)
        self.reservation.on_step(idle=not life.requests)
        if self.tier is not None:  # before this step's allocations evict anything
            self.tier.write_back()
        if self._pd is not None:
            self._pd.on_schedule(out)
        out.preempted, out.offloads = self.preemption.preempt_for_decodes(
            None if self.tier is None else self.tier.num_saving)
        victims = out.preempted
        counters = self._counters
        counters.num_preemptions_offload += len(out.offloads)
        counters.num_preemptions_recompute += len(victims) - len(out.offloads)
        seqs = out.seqs
        self._schedule_decodes(seqs)
        out.num_decodes = len(seqs)
        if not victims and life.offloaded:
            out.restores = self.preemption.resume(config.max_num_seqs - life.num_running,
                                                  self.admission.blocks_kept_back())
        # Preempted requests come back before anything new is admitted.
        admit = not victims and not life.offloaded and not life.offloading
        self._scheduled_prefills, budget = self.admission.schedule_prefills(
            config.max_num_batched_tokens - len(seqs), seqs, admit, out.prefix_loads)
        out.num_scheduled_tokens = config.max_num_batched_tokens - budget
        if self.tier is not None:
            out.prefix_saves = self.tier.take_saves()
        return out

    def _schedule_decodes(self, seqs: list[ScheduledSeq]) -> None:
        """One token for every decode request; a new block for each that filled its last."""
        block_size = self.config.block_size
        append_block = self.kv.append_block
        add_seq = seqs.append
        decoding = self.life.decoding.values()
        # Those left without a block last step get one first: else the blocks
        # freed for them (a finished decode's) go to decodes ahead in the
        # queue that filled theirs since, and they wait step after step.
        for req in self._stalled:
            if req.status is RUNNING_DECODE and req.num_computed_tokens >= len(
                    req.block_ids) * block_size:
                append_block(req)
        self._stalled = stalled = []
        for req in decoding:
            num_computed = req.num_computed_tokens
            block_ids = req.block_ids
            if num_computed >= len(block_ids) * block_size and not append_block(req):
                stalled.append(req)  # its block comes from a snapshot copy still in flight
                continue
            seq = req.decode_seq
            if seq is None:
                seq = req.decode_seq = ScheduledSeq(
                    req.request_id, [req.output_token_ids[-1]], num_computed, block_ids, True,
                    req.sampling)
            else:
                seq.token_ids = [req.output_token_ids[-1]]
                seq.start_pos = num_computed
                seq.block_ids = block_ids
            add_seq(seq)
        # A copy: abort() may change the queue before update().
        self._scheduled_decodes = [r for r in decoding if r not in stalled] if stalled else (
            list(decoding))

    # ----------------------------------------------------------------- update

    def update(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int]
    ) -> list[RequestUpdate]:
        """Records a step's results; ignores requests aborted since schedule()."""
        seqs = output.seqs
        decodes = self._scheduled_decodes
        prefills = self._scheduled_prefills
        if output.step_id != self._step_id or self._updated_step_id == output.step_id:
            raise FailedPrecondition(
                f"output of step {output.step_id} is stale or already applied "
                f"(latest step {self._step_id})"
            )
        if len(seqs) != len(decodes) + len(prefills):
            raise InvalidArgument(
                f"output of step {output.step_id} has {len(seqs)} seqs, "
                f"{len(decodes) + len(prefills)} were scheduled"
            )
        # Every token is checked before any state changes: a refused update leaves none.
        for req in decodes:
            if req.request_id not in sampled_token_ids and req.status is RUNNING_DECODE:
                raise InvalidArgument(f"no sampled token for request {req.request_id}")
        for seq, req in zip(islice(seqs, len(decodes), None), prefills, strict=True):
            if seq.sample and req.request_id not in sampled_token_ids and (
                    req.status is RUNNING_PREFILL and req.num_computed_tokens == seq.start_pos):
                raise InvalidArgument(f"no sampled token for request {req.request_id}")
        vocab_size = self.config.vocab_size
        for request_id, token_id in sampled_token_ids.items():
            if not 0 <= token_id < vocab_size:
                raise InvalidArgument(f"sampled token {token_id} for request {request_id} "
                                      f"is outside the vocabulary of {vocab_size}")
        self._updated_step_id = output.step_id
        block_size = self.config.block_size
        cache_full_blocks = self.kv.cache_full_blocks
        for req in decodes:
            if req.status is RUNNING_DECODE:  # else aborted since schedule()
                num_computed = req.num_computed_tokens + 1
                req.num_computed_tokens = num_computed
                if not num_computed % block_size:
                    cache_full_blocks(req)
        completed: list[Request] = []  # prefills that sampled their first token
        for seq, req in zip(islice(seqs, len(decodes), None), prefills, strict=True):
            if req.status is not RUNNING_PREFILL or req.num_computed_tokens != seq.start_pos:
                continue  # aborted (and maybe re-added) since schedule()
            self._record_chunk(req, seq)
            if not seq.sample:
                continue
            req.recompute_until = 0
            self.life.move(req, RUNNING_DECODE)
            if req.first_token_time is None:
                req.first_token_time = self._clock()
                self._counters.num_prompt_tokens += req.num_prompt_tokens
            completed.append(req)
        if completed and self.tier is not None:
            for req in completed:
                self.tier.on_prefilled(req)
        if completed and self._pd is not None:
            self._pd.on_prefilled(completed)
        updates: list[RequestUpdate] = []
        add_update = updates.append
        for req in chain(decodes, completed):
            if req.status is not RUNNING_DECODE:
                continue  # aborted since schedule()
            request_id = req.request_id
            token_id = sampled_token_ids[request_id]
            output_ids = req.output_token_ids
            output_ids.append(token_id)
            if token_id in req.stop_ids or len(output_ids) >= req.sampling.max_tokens:
                add_update(self._finish(req, token_id))
            else:
                add_update(RequestUpdate(request_id, [token_id],
                                         num_cached_tokens=req.num_cached_tokens))
        self._counters.num_generation_tokens += len(updates)  # one new token each
        return updates

    def _finish(self, req: Request, token_id: int) -> RequestUpdate:
        """token_id, just appended, ends req: max_tokens reached (a length
        end, whatever the token: vLLM and SGLang look at the length first),
        else a stop token."""
        status = (FINISHED_LENGTH if len(req.output_token_ids) >= req.sampling.max_tokens
                  else FINISHED_STOPPED)
        self.life.finish(req, status)
        if self._pd is not None:
            self._pd.on_finish(req)
        return RequestUpdate(req.request_id, [token_id], status, req.usage(),
                             req.num_cached_tokens)

    def _record_chunk(self, req: Request, seq: ScheduledSeq) -> None:
        start = seq.start_pos
        end = start + len(seq.token_ids)
        if start < req.recompute_until:
            num_recomputed = min(end, req.recompute_until) - start
            req.num_recomputed_tokens += num_recomputed
            self._counters.num_recomputed_tokens += num_recomputed
        req.num_computed_tokens = end
        self.kv.cache_full_blocks(req)

    # ------------------------------------------------------- engine callbacks

    def abort(self, request_id: str) -> RequestUsage:
        """Finishes a live request in any state (NotFound otherwise); returns its
        figures. A copy in flight keeps its blocks until it lands."""
        req = self.life.abort(request_id)
        if self._pd is not None:
            self._pd.on_abort(req)
        return req.usage()

    def finish_offload(
        self, cmd: OffloadCommand, num_bytes: int | None, seconds: float | None = None
    ) -> None:
        """The snapshot is committed (num_bytes) or the copy failed (None);
        `seconds`, the copy's duration, teaches the cost model."""
        self.life.finish_offload(cmd, num_bytes)
        if num_bytes is not None and seconds is not None:
            self.preemption.costs.observe_offload(len(cmd.block_ids), seconds)

    def finish_restore(
        self, cmd: RestoreCommand, num_bytes: int | None, seconds: float | None = None
    ) -> None:
        """The snapshot's num_bytes are back in the request's blocks, or the copy
        failed (None); `seconds` as for finish_offload."""
        self.life.finish_restore(cmd, num_bytes)
        if num_bytes is not None and seconds is not None:
            self.preemption.costs.observe_restore(len(cmd.block_ids), seconds)

    def finish_prefix_load(
        self, load: PrefixLoad, num_loaded: int, num_bytes: int, seconds: float | None = None
    ) -> None:
        """The first `num_loaded` segments of `load` (num_bytes) are in the
        request's blocks; it prefills the rest. `seconds`, the whole load's
        duration when every segment landed, teaches the cost model."""
        if not 0 <= num_loaded <= len(load.segments):
            raise InvalidArgument(f"{num_loaded} of {len(load.segments)} segments loaded")
        assert self.tier is not None, "only a scheduler with a prefix tier loads segments"
        num_tokens = self.tier.tokens_of(load.segments[:num_loaded])
        self.tier.finish_load(self.life.finish_load(load.load_id, num_tokens), load,
                              num_loaded, num_bytes, seconds)

    def finish_prefix_save(self, cmd: OffloadCommand, num_bytes: int | None) -> None:
        """A prefix-tier segment is stored (num_bytes; 0 where another
        instance stored it first) or its save failed (None)."""
        assert self.tier is not None, "only a scheduler with a prefix tier saves segments"
        self.tier.finish_save(cmd, num_bytes)

    # ------------------------------------------------------------- measures

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """The worker computed `output`'s seqs in `seconds`: teaches the cost
        model the prefill rate."""
        self.preemption.costs.observe_step(output.seqs, output.num_decodes, seconds)

    def set_cache_available(self, available: bool) -> None:
        """Whether the cache service answers: AUTO offloads, and the prefix
        tier saves, only while it does."""
        self.preemption.cache_available = available
        if self.tier is not None:
            self.tier.cache_answers = available

    def requests_on_worker(self) -> list[str]:
        """The live requests whose state a lost worker took with it, to fail:
        their KV was there (RUNNING_PREFILL, RUNNING_DECODE) or being copied
        to or from it (OFFLOADING, RESUMING, HANDING_OFF). They are not
        recomputed: one of them may be what killed the worker (an input that
        crashes it, an allocation it cannot make), and run again it could
        take the next worker down too, with every request waiting for it.
        Every other request keeps its state out of the worker's reach
        (WAITING its tokens, OFFLOADED and HANDED_OFF a snapshot in the
        cache, RESERVED blocks nothing was written to yet) and can run on
        the next worker."""
        life = self.life
        return [*life.prefilling, *life.decoding, *life.offloading, *life.resuming,
                *life.loading, *life.handing_off]

    def reset_prefix_cache(self, kv_lost: bool = True) -> int:
        """Forgets every cached prefix. `kv_lost`: the worker's KV tensor was
        lost (it restarted), so no cached block holds what its hash says, and
        no segment save not yet sent may read them; else an operator's flush,
        after which the saves queued still go out. Returns the blocks freed."""
        if self.tier is not None:
            self.tier.forget_blocks(kv_lost)
        return self.kv.pool.reset_prefix_cache()

    def record_kv_events(self) -> None:
        """From now on, the prefix cache's changes are kept for take_kv_events."""
        if self.kv.pool.events is None:
            self.kv.pool.events = KvEventLog()

    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's changes since the last call (kv_events.py)."""
        events = self.kv.pool.events
        return [] if events is None else events.take()

    def take_snapshots_to_delete(self) -> list[str]:
        return self.life.take_snapshots_to_delete()

    # ------------------------------------------------------------ inspection

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.life.requests)

    @property
    def is_idle(self) -> bool:
        """Nothing to schedule and nothing in flight: no request of any kind held."""
        return self.life.is_idle and (self.tier is None or not self.tier.saves)

    def cost_estimates(self) -> CostEstimates:
        """What the cost model learned so far (preemption.py, costs.py)."""
        return self.preemption.costs.estimates()

    def stats(self) -> SchedulerStats:
        """Every counter as it stands, and the figures read from the state now."""
        pool = self.kv.pool
        life = self.life
        return SchedulerStats(
            **values(self._counters),
            num_steps=self._step_id,
            num_total_blocks=pool.num_blocks,
            block_size=self.config.block_size,
            num_free_blocks=pool.num_free_blocks,
            num_evictable_blocks=pool.num_evictable_blocks,
            num_running_prefill=len(life.prefilling),
            num_running_decode=len(life.decoding),
            num_waiting=len(life.waiting),
            num_offloaded=life.num_preempted,
            new_token_ratio=self.reservation.new_token_ratio,
            cache_available=self.preemption.cache_available,
            num_reserved=len(life.reserved),
            num_loading=len(life.loading),
            num_handed_off=len(life.handing_off) + len(life.handed_off),
        )

    def check_integrity(self) -> None:
        """Raises IntegrityError naming the first broken invariant (invariants.py).

        O(pool + requests): call it in tests and when idle, not every step."""
        check_scheduler(self.config, self.life, self.reservation, self._pd, self.tier)
