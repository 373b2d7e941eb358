"""Scheduler: one step's decisions, and the bookkeeping of its results.

`schedule()`, in order:

    1. preempt   if the running decodes need more blocks than are free
                 (preemption.py: victims, offload or recompute by costs.py)
    2. decode    every RUNNING_DECODE request: one token, a block if it needs one
    3. resume    OFFLOADED requests back into fresh blocks (preemption.py)
    4. prefill   running chunks, then admissions from WAITING (admission.py);
                 nothing new is admitted while a preempted request waits

`update()` records what the worker computed: progress, tokens, finishes.
An output never updated changes nothing but the blocks it allocated. Every
status change goes through `Lifecycle.move` (lifecycle.py).

P/D disaggregation, the same core in either role:
    prefill instance  a request added with handoff=True is, once its first
                      token is sampled, handed off at the next schedule():
                      its blocks are copied out (`out.handoffs`), then it is
                      HANDED_OFF while a decode instance decodes it
                      (`remote_tokens`, `finish_remote`; `take_back` if lost)
    decode instance   `reserve()` holds a prompt's blocks under admission's
                      rule (never by preempting); `start_remote_decode()`
                      restores the prefill instance's snapshot into them;
                      unused reservations expire at schedule()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from itertools import chain, islice

from kvstash.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from kvstash.sampling import SamplingParams
from kvstash.stats import values
from scheduler_svc.core.admission import Admission
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.costs import CostEstimates
from scheduler_svc.core.intake import check_new_request
from scheduler_svc.core.invariants import check_scheduler
from scheduler_svc.core.kv_events import KvEvent, KvEventLog
from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.core.lifecycle import (
    FINISHED_LENGTH,
    FINISHED_STOPPED,
    HANDED_OFF,
    HANDING_OFF,
    RESERVED,
    RUNNING_DECODE,
    RUNNING_PREFILL,
    Lifecycle,
)
from scheduler_svc.core.outputs import (
    Counters,
    OffloadCommand,
    RequestUpdate,
    RestoreCommand,
    ScheduledSeq,
    SchedulerOutput,
    SchedulerStats,
)
from scheduler_svc.core.preemption import Preemption
from scheduler_svc.core.request import Request, RequestStatus, RequestUsage
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
        self.admission = Admission(config, self.life, self.reservation, clock)
        self._clock = clock
        self._num_arrivals = 0
        self._step_id = 0
        self._updated_step_id = 0
        # The requests behind the latest output's seqs: its decodes, then its prefills.
        self._scheduled_decodes: list[Request] = []
        self._scheduled_prefills: list[Request] = []
        # Prefilled requests to hand off at the next schedule() (P/D).
        self._to_hand_off: list[Request] = []

    def check_request(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> None:
        """What add_request checks before it changes anything: InvalidArgument,
        AlreadyExists."""
        check_new_request(self.config, request_id, tuple(prompt_token_ids), sampling)
        if request_id in self.life.requests:
            raise AlreadyExists(f"request {request_id} already exists")

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
        *, handoff: bool = False,
    ) -> Request:
        """A new request, WAITING. `handoff`: a decode instance reserved blocks
        for it; once prefilled it goes there (P/D)."""
        self.check_request(request_id, prompt_token_ids, sampling)
        if len(self.life.waiting) >= self.config.max_num_waiting:
            raise ResourceExhausted(
                f"request {request_id}: the waiting queue is full ({len(self.life.waiting)} "
                f"requests, max_num_waiting {self.config.max_num_waiting}); retry later")
        req = self._new_request(request_id, prompt_token_ids, sampling)
        req.handoff = handoff
        self.life.add(req)
        return req

    def _new_request(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
        status: RequestStatus = RequestStatus.WAITING,
    ) -> Request:
        req = Request.create(
            request_id, prompt_token_ids, sampling, arrival_time=self._clock(),
            arrival_seq=self._num_arrivals, eos_token_ids=self.config.eos_token_ids,
            status=status,
        )
        self._num_arrivals += 1
        return req

    def get_request(self, request_id: str) -> Request | None:
        return self.life.requests.get(request_id)

    # --------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        config = self.config
        life = self.life
        self._step_id += 1
        out = SchedulerOutput(step_id=self._step_id)
        self.reservation.on_step(idle=not life.requests)
        if life.reserved:
            life.expire_reservations(self._clock())
        if self._to_hand_off:
            out.handoffs = [life.start_offload(r, HANDING_OFF) for r in self._to_hand_off
                            if r.status is RUNNING_DECODE]
            self._to_hand_off = []
        out.preempted, out.offloads = self.preemption.preempt_for_decodes()
        victims = out.preempted
        counters = self._counters
        counters.num_preemptions_offload += len(out.offloads)
        counters.num_preemptions_recompute += len(victims) - len(out.offloads)
        seqs = out.seqs
        self._schedule_decodes(seqs)
        out.num_decodes = len(seqs)
        if not victims and life.offloaded:
            out.restores = self.preemption.resume(config.max_num_seqs - life.num_running)
        # Preempted requests come back before anything new is admitted.
        admit = not victims and not life.offloaded and not life.offloading
        self._scheduled_prefills, budget = self.admission.schedule_prefills(
            config.max_num_batched_tokens - len(seqs), seqs, admit)
        out.num_scheduled_tokens = config.max_num_batched_tokens - budget
        return out

    def _schedule_decodes(self, seqs: list[ScheduledSeq]) -> None:
        """One token for every decode request; a new block for each that filled its last."""
        block_size = self.config.block_size
        append_block = self.kv.append_block
        add_seq = seqs.append
        decoding = self.life.decoding.values()
        stalled: list[Request] = []
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
            if req.handoff:
                self._to_hand_off.append(req)
            if req.first_token_time is None:
                req.first_token_time = self._clock()
                self._counters.num_prompt_tokens += req.num_prompt_tokens
            completed.append(req)
        updates: list[RequestUpdate] = []
        add_update = updates.append
        for req in chain(decodes, completed):
            if req.status is not RUNNING_DECODE:
                continue  # aborted since schedule()
            request_id = req.request_id
            try:
                token_id = sampled_token_ids[request_id]
            except KeyError:
                raise InvalidArgument(f"no sampled token for request {request_id}") from None
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
        """token_id, just appended, ends req (a stop token, or max_tokens reached)."""
        status = FINISHED_STOPPED if token_id in req.stop_ids else FINISHED_LENGTH
        self.life.finish(req, status)
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
        return self.life.abort(request_id).usage()

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

    # ------------------------------------------------------------------ P/D

    def reserve(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> bool:
        """Decode instance: holds the blocks a prefill instance's request needs
        (raises as add_request does). Accepted only if admission's reservations
        (the request's own included) still fit after it, a seat is free and no
        preempted request waits; False otherwise: nothing changed, ask again later."""
        self.check_request(request_id, prompt_token_ids, sampling)
        if sampling.max_tokens < 2:
            raise InvalidArgument(f"request {request_id}: max_tokens {sampling.max_tokens} "
                                  "leaves nothing to decode after prefill")
        req = self._new_request(request_id, prompt_token_ids, sampling, RESERVED)
        life = self.life
        # As admission: nothing new while a preempted request waits to come back.
        if (life.num_running >= self.config.max_num_seqs or life.waiting or life.offloaded
                or life.offloading):
            self._counters.num_reservations_refused += 1
            return False
        # Its own growth beyond the prompt's blocks, which life.reserve allocates.
        growth = self.reservation.reserved_blocks(
            req, num_held=self.kv.num_blocks_for(req.num_prompt_tokens))
        kept_back = self.admission.blocks_kept_back() + growth
        return life.reserve(req, kept_back, self._clock() + self.config.reservation_timeout_s)

    def start_remote_decode(
        self, request_id: str, snapshot_id: str, num_tokens: int, first_token_id: int
    ) -> RestoreCommand:
        """Decode instance: the KV of a RESERVED request's prompt is in
        snapshot_id and its first token was sampled; the copy into its blocks
        starts (answered with finish_restore), then it decodes here."""
        req = self.life.requests.get(request_id)
        if req is None or req.status is not RESERVED:
            raise NotFound(f"request {request_id} holds no reservation (never made, "
                           "expired, or already used)")
        if num_tokens != req.num_prompt_tokens:
            raise InvalidArgument(f"request {request_id}: the snapshot holds {num_tokens} "
                                  f"tokens, its prompt has {req.num_prompt_tokens}")
        if snapshot_id in self.life.copies:
            raise AlreadyExists(f"request {request_id}: snapshot {snapshot_id} is already "
                                "being copied here")
        if not 0 <= first_token_id < self.config.vocab_size or first_token_id in req.stop_ids:
            raise InvalidArgument(f"request {request_id}: first token {first_token_id} is "
                                  "outside the vocabulary or ends the request")
        return self.life.start_remote_decode(req, snapshot_id, first_token_id)

    def finish_handoff(
        self, cmd: OffloadCommand, num_bytes: int | None, seconds: float | None = None
    ) -> bool:
        """Prefill instance: the handoff copy landed. True: the request is
        HANDED_OFF (ask the decode instance to decode it); False: it decodes
        here (the copy failed) or was aborted."""
        req = self.life.finish_handoff(cmd, num_bytes)
        if num_bytes is not None and seconds is not None:
            self.preemption.costs.observe_offload(len(cmd.block_ids), seconds)
        return req.status is HANDED_OFF

    def remote_tokens(self, request_id: str, token_ids: Sequence[int]) -> RequestUpdate | None:
        """Prefill instance: tokens the decode instance generated; None if the
        request is no longer HANDED_OFF (aborted). InvalidArgument for tokens
        it could not have generated (_check_remote_tokens)."""
        req = self._handed_off(request_id)
        if req is None:
            return None
        self._check_remote_tokens(req, token_ids)
        req.output_token_ids.extend(token_ids)
        self._counters.num_generation_tokens += len(token_ids)
        return RequestUpdate(request_id, list(token_ids),
                             num_cached_tokens=req.num_cached_tokens)

    def finish_remote(
        self, request_id: str, token_ids: Sequence[int], stopped: bool, remote: RequestUsage
    ) -> RequestUpdate | None:
        """Prefill instance: the decode instance finished the request with
        token_ids (stop token or length, `stopped` says which); its
        preemptions there count in the usage. InvalidArgument (nothing
        recorded) for an end that does not match the tokens."""
        req = self._handed_off(request_id)
        if req is None:
            return None
        output = [*req.output_token_ids, *token_ids]
        if stopped != (output[-1] in req.stop_ids) or (
                not stopped and len(output) != req.sampling.max_tokens):
            raise InvalidArgument(
                f"request {request_id}: a remote {'stop' if stopped else 'length'} finish "
                f"after {len(output)} tokens ending in {output[-1]} (max_tokens "
                f"{req.sampling.max_tokens})")
        update = self.remote_tokens(request_id, token_ids)
        assert update is not None
        req.num_preemptions += remote.num_preemptions
        req.num_recomputed_tokens += remote.num_recomputed_tokens
        req.bytes_offloaded += remote.bytes_offloaded
        req.snapshot = None  # the decode instance read it
        self.life.finish(req, FINISHED_STOPPED if stopped else FINISHED_LENGTH)
        update.finish_status = req.status
        update.usage = req.usage()
        return update

    def _check_remote_tokens(self, req: Request, token_ids: Sequence[int]) -> None:
        """What a decode instance sends must be possible: InvalidArgument (and
        nothing recorded) for tokens outside the vocabulary, beyond max_tokens
        or after a stop token."""
        vocab_size = self.config.vocab_size
        num_output = len(req.output_token_ids)
        for i, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab_size:
                raise InvalidArgument(f"request {req.request_id}: remote token {token_id} is "
                                      f"outside the vocabulary [0, {vocab_size})")
            if i < len(token_ids) - 1 and token_id in req.stop_ids:
                raise InvalidArgument(f"request {req.request_id}: remote tokens go on after "
                                      f"stop token {token_id}")
        if num_output + len(token_ids) > req.sampling.max_tokens:
            raise InvalidArgument(f"request {req.request_id}: {num_output} + {len(token_ids)} "
                                  f"remote tokens exceed max_tokens {req.sampling.max_tokens}")

    def take_back(self, request_id: str) -> None:
        """Prefill instance: the decode instance was lost; the request finishes
        here (Lifecycle.take_back). Nothing if it is no longer HANDED_OFF."""
        if (req := self._handed_off(request_id)) is not None:
            self.life.take_back(req)

    def _handed_off(self, request_id: str) -> Request | None:
        req = self.life.requests.get(request_id)
        return req if req is not None and req.status is HANDED_OFF else None

    # ------------------------------------------------------------- measures

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """The worker computed `output`'s seqs in `seconds`: teaches the cost
        model the prefill rate."""
        self.preemption.costs.observe_step(output.seqs, output.num_decodes, seconds)

    def set_cache_available(self, available: bool) -> None:
        """Whether the cache service answers: AUTO offloads only while it does."""
        self.preemption.cache_available = available

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix: the worker's KV tensor was lost (it
        restarted), so no cached block holds what its hash says. Returns the
        blocks freed."""
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
        return self.life.is_idle

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
            num_handed_off=len(life.handing_off) + len(life.handed_off),
        )

    def check_integrity(self) -> None:
        """Raises IntegrityError naming the first broken invariant (invariants.py).

        O(pool + requests): call it in tests and when idle, not every step."""
        check_scheduler(self.config, self.life, self.reservation)
