"""Scheduler: admission, batching and the step loop's bookkeeping.

One step, in order:

    1. preempt   if running decodes need more blocks than are free (counting
                 blocks of snapshots already in flight as soon free), preempt
                 RUNNING_DECODE victims: shortest output, then longest prompt;
                 one decode always keeps running (preemption.py offloads or
                 recomputes each)
    2. decode    every RUNNING_DECODE request: one token, a block if it needs one
    3. resume    OFFLOADED requests, oldest first, when free blocks cover the
                 snapshot plus headroom for the running decodes
    4. prefill   running chunked prefills, then admissions from WAITING (front
                 first), under the token budget, max_num_seqs and reservation

Admission allocates every block of the prefill at once, so a prefill in
progress never needs blocks and is never a victim. Progress is recorded in
`update()`, not `schedule()`: an output never updated changes nothing but
the blocks it allocated.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from itertools import chain, islice

from kvstash.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from scheduler_svc.block_pool import IntegrityError
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.intake import check_new_request
from scheduler_svc.invariants import check_requests
from scheduler_svc.kv_manager import KVCacheManager
from scheduler_svc.outputs import RequestUpdate, ScheduledSeq, SchedulerOutput, SchedulerStats
from scheduler_svc.preemption import Preemption
from scheduler_svc.request import Request, RequestStatus, SamplingParams
from scheduler_svc.reservation import Reservation

WAITING = RequestStatus.WAITING
RUNNING_PREFILL = RequestStatus.RUNNING_PREFILL
RUNNING_DECODE = RequestStatus.RUNNING_DECODE
FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED
FINISHED_LENGTH = RequestStatus.FINISHED_LENGTH
FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size)
        self.reservation = Reservation(config)
        self._preemption = Preemption(config, self.kv, self.reservation)
        self._clock = clock
        # Every unfinished request, plus aborted ones whose copy is in flight.
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._prefilling: list[Request] = []
        self._decoding: list[Request] = []
        self._num_arrivals = 0
        self._step_id = 0
        self._updated_step_id = 0
        # The requests behind the latest output's seqs: its decodes, then its prefills.
        self._scheduled_decodes: list[Request] = []
        self._scheduled_prefills: list[Request] = []
        self._num_recomputed_tokens = 0
        self._num_finished = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    # ----------------------------------------------------------------- intake

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Request:
        prompt = tuple(prompt_token_ids)
        check_new_request(self.config, request_id, prompt, sampling)
        if request_id in self._requests:
            raise AlreadyExists(f"request {request_id} already exists")
        req = Request.create(
            request_id, prompt, sampling, arrival_time=self._clock(),
            arrival_seq=self._num_arrivals, eos_token_ids=self.config.eos_token_ids,
        )
        self._num_arrivals += 1
        self._requests[request_id] = req
        self._waiting.append(req)
        return req

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # --------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        config = self.config
        self._step_id += 1
        out = SchedulerOutput(step_id=self._step_id)
        self.reservation.on_step(idle=not self.has_unfinished_requests)
        preempted = self._preempt_for_decodes(out)
        seqs = out.seqs
        self._schedule_decodes(seqs)
        self._scheduled_prefills = []
        budget = config.max_num_batched_tokens - len(seqs)
        preemption = self._preemption
        if not preempted and preemption.offloaded:
            num_seats = config.max_num_seqs - self._num_running()
            out.restores = preemption.resume(num_seats, self._headroom_blocks())
        for req in self._prefilling:
            if budget == 0:
                break
            budget -= self._schedule_chunk(req, budget, seqs)
        # Preempted requests come back before anything new is admitted.
        if not preempted and not preemption.offloaded and not preemption.num_live_offloading():
            budget = self._admit(budget, seqs)
        out.num_scheduled_tokens = config.max_num_batched_tokens - budget
        return out

    def _preempt_for_decodes(self, out: SchedulerOutput) -> bool:
        """Preempts decode requests until every running decode can get its block."""
        victims, out.offloads = self._preemption.preempt_for_decodes(self._decoding)
        if not victims:
            return False
        for victim in victims:
            if victim.status is WAITING:  # recompute: its KV is already dropped
                self._requeue(victim)
        self._decoding = [r for r in self._decoding if r.status is RUNNING_DECODE]
        self.reservation.on_preemption(self._decoding)
        return True

    def _schedule_decodes(self, seqs: list[ScheduledSeq]) -> None:
        """One token for every decode request; a new block for each that filled its last."""
        block_size = self.config.block_size
        append_block = self.kv.append_block
        add_seq = seqs.append
        decoding = self._decoding
        stalled: list[Request] = []
        for req in decoding:
            num_computed = req.num_computed_tokens
            block_ids = req.block_ids
            if num_computed >= len(block_ids) * block_size and not append_block(req):
                stalled.append(req)  # its block comes from a snapshot copy still in flight
                continue
            # Reused, not rebuilt: like block_ids, valid until the next schedule().
            seq = req.decode_seq
            if seq is None:
                seq = req.decode_seq = ScheduledSeq(
                    req.request_id, [req.output_token_ids[-1]], num_computed, block_ids, True,
                    req.sampling,
                )
            else:
                seq.token_ids = [req.output_token_ids[-1]]
                seq.start_pos = num_computed
                seq.block_ids = block_ids
            add_seq(seq)
        if stalled:
            self._scheduled_decodes = [r for r in decoding if r not in stalled]
        else:
            self._scheduled_decodes = decoding.copy()  # abort() may edit _decoding

    def _headroom_blocks(self) -> int:
        """Blocks the running decodes may claim soon: their reservation plus one step each."""
        decoding = self._decoding
        return (
            self.reservation.total_reserved_blocks(decoding)
            + self.config.resume_headroom * len(decoding)
        )

    def _schedule_chunk(self, req: Request, budget: int, seqs: list[ScheduledSeq]) -> int:
        start = req.num_computed_tokens
        end = min(req.num_tokens, start + budget)
        seqs.append(ScheduledSeq(
            req.request_id, req.token_ids(start, end), start, req.block_ids,
            end == req.num_tokens, req.sampling,
        ))
        self._scheduled_prefills.append(req)
        return end - start

    def _admit(self, budget: int, seqs: list[ScheduledSeq]) -> int:
        """Admits WAITING requests in order while blocks, budget and seats last."""
        waiting = self._waiting
        if not waiting or budget == 0:
            return budget
        config = self.config
        reservation = self.reservation
        kv = self.kv
        chunk_limit = config.max_num_batched_tokens
        # A prefill whose next chunk completes its prompt is about to decode,
        # and a resuming request decodes as soon as its restore lands.
        reserved = (
            reservation.total_reserved_blocks(self._decoding)
            + sum(reservation.reserved_blocks(r) for r in self._prefilling
                  if r.num_tokens - r.num_computed_tokens <= chunk_limit)
            + sum(reservation.reserved_blocks(r) for r in self._preemption.resuming.values()
                  if r.status is RequestStatus.RESUMING)
        )
        num_running = self._num_running()
        while waiting and budget > 0 and num_running < config.max_num_seqs:
            req = waiting[0]
            prefix_block_ids = kv.find_prefix(req)
            num_new_tokens = req.num_tokens - len(prefix_block_ids) * config.block_size
            if kv.allocate_slots(req, num_new_tokens, prefix_block_ids, reserved) is None:
                break
            waiting.popleft()
            req.status = RUNNING_PREFILL
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self._clock()
            self._prefilling.append(req)
            num_running += 1
            if req.num_tokens - req.num_computed_tokens <= chunk_limit:
                reserved += reservation.reserved_blocks(req)
            budget -= self._schedule_chunk(req, budget, seqs)
        return budget

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
        updates: list[RequestUpdate] = []
        add_update = updates.append
        block_size = self.config.block_size
        cache_full_blocks = self.kv.cache_full_blocks
        num_finished = 0
        for req in decodes:
            if req.status is not RUNNING_DECODE:
                continue  # aborted since schedule()
            num_computed = req.num_computed_tokens + 1
            req.num_computed_tokens = num_computed
            if not num_computed % block_size:
                cache_full_blocks(req)
            request_id = req.request_id
            try:
                token_id = sampled_token_ids[request_id]
            except KeyError:
                raise InvalidArgument(f"no sampled token for request {request_id}") from None
            output_ids = req.output_token_ids
            output_ids.append(token_id)
            if token_id in req.stop_ids or len(output_ids) >= req.sampling.max_tokens:
                add_update(self._finish(req, token_id))
                num_finished += 1
            else:
                add_update(RequestUpdate(request_id, [token_id], None))
        for seq, req in zip(islice(seqs, len(decodes), None), prefills, strict=True):
            if req.status is not RUNNING_PREFILL or req.num_computed_tokens != seq.start_pos:
                continue  # aborted (and maybe re-added) since schedule()
            self._record_chunk(req, seq)
            if not seq.sample:
                continue
            req.recompute_until = 0
            req.status = RUNNING_DECODE
            self._decoding.append(req)
            if req.first_token_time is None:
                req.first_token_time = self._clock()
                self._num_prompt_tokens += req.num_prompt_tokens
            update = self._take_token(req, sampled_token_ids)
            add_update(update)
            if update.finish_status is not None:
                num_finished += 1
        if prefills:
            self._prefilling = [r for r in self._prefilling if r.status is RUNNING_PREFILL]
        if num_finished:
            self._decoding = [r for r in self._decoding if r.status is RUNNING_DECODE]
        self._num_generation_tokens += len(updates)  # one new token each
        return updates

    def _take_token(self, req: Request, sampled_token_ids: Mapping[str, int]) -> RequestUpdate:
        """Appends req's sampled token (inlined in update()'s decode loop, the hot path)."""
        request_id = req.request_id
        try:
            token_id = sampled_token_ids[request_id]
        except KeyError:
            raise InvalidArgument(f"no sampled token for request {request_id}") from None
        output_ids = req.output_token_ids
        output_ids.append(token_id)
        if token_id in req.stop_ids or len(output_ids) >= req.sampling.max_tokens:
            return self._finish(req, token_id)
        return RequestUpdate(request_id, [token_id], None)

    def _finish(self, req: Request, token_id: int) -> RequestUpdate:
        """token_id, just appended, ends req (a stop token, or max_tokens reached)."""
        status = FINISHED_STOPPED if token_id in req.stop_ids else FINISHED_LENGTH
        req.status = status
        self.kv.free(req)
        del self._requests[req.request_id]
        self._num_finished += 1
        return RequestUpdate(req.request_id, [token_id], status)

    def _record_chunk(self, req: Request, seq: ScheduledSeq) -> None:
        start = seq.start_pos
        end = start + len(seq.token_ids)
        if start < req.recompute_until:
            num_recomputed = min(end, req.recompute_until) - start
            req.num_recomputed_tokens += num_recomputed
            self._num_recomputed_tokens += num_recomputed
        req.num_computed_tokens = end
        self.kv.cache_full_blocks(req)

    # ------------------------------------------------------- engine callbacks

    def abort(self, request_id: str) -> None:
        """Finishes a request in any state; a copy in flight keeps its blocks until it lands."""
        req = self._requests.get(request_id)
        if req is None or req.status.is_finished:
            raise NotFound(f"request {request_id} is unknown or already finished")
        status = req.status
        req.status = FINISHED_ABORTED
        self._num_finished += 1
        if status is WAITING:
            self._waiting.remove(req)
        elif status is RUNNING_PREFILL:
            self._prefilling.remove(req)
            self.kv.free(req)
        elif status is RUNNING_DECODE:
            self._decoding.remove(req)
            self.kv.free(req)
        elif not self._preemption.abort(req):
            return  # finish_offload / finish_restore release it
        del self._requests[request_id]

    def finish_offload(self, request_id: str, num_bytes: int | None) -> None:
        """The snapshot is committed (num_bytes) or the copy failed (None)."""
        self._file(self._preemption.finish_offload(self._known(request_id), num_bytes))

    def finish_restore(self, request_id: str, ok: bool) -> None:
        """The snapshot is back in the request's blocks (ok) or the copy failed."""
        self._file(self._preemption.finish_restore(self._known(request_id), ok))

    def _known(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise NotFound(f"request {request_id} is unknown")
        return req

    def _requeue(self, req: Request) -> None:
        """Back to WAITING to be recomputed: ahead of every new arrival, behind
        preempted requests that arrived before it (they keep their places)."""
        waiting = self._waiting
        i = 0
        while (i < len(waiting) and waiting[i].output_token_ids
               and waiting[i].arrival_seq < req.arrival_seq):
            i += 1
        waiting.insert(i, req)

    def _file(self, req: Request) -> None:
        """Puts a request whose copy just landed where its new status says."""
        status = req.status
        if status is FINISHED_ABORTED:
            del self._requests[req.request_id]
        elif status is WAITING:
            self._requeue(req)
        elif status is RUNNING_DECODE:
            self._decoding.append(req)
        # OFFLOADED: stays with the preemption layer until it resumes.

    def set_offload_capacity(self, free_bytes: int | None) -> None:
        """Free bytes the cache service reported; None = unreachable (recompute)."""
        self._preemption.set_capacity(free_bytes)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix: the worker's KV tensor was lost (it
        restarted), so no cached block holds what its hash says. Returns the
        blocks freed."""
        return self.kv.pool.reset_prefix_cache()

    def take_snapshots_to_delete(self) -> list[str]:
        return self._preemption.take_snapshots_to_delete()

    # ------------------------------------------------------------ inspection

    def _num_running(self) -> int:
        return (
            len(self._prefilling) + len(self._decoding) + self._preemption.num_live_resuming()
        )

    @property
    def has_unfinished_requests(self) -> bool:
        preemption = self._preemption
        return bool(
            self._waiting or self._prefilling or self._decoding or preemption.offloaded
            or preemption.num_live_offloading() or preemption.num_live_resuming()
        )

    @property
    def is_idle(self) -> bool:
        """Nothing to schedule and nothing in flight: no request of any kind held."""
        return not self._requests and not self._preemption.has_snapshots_to_delete

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        preemption = self._preemption
        return SchedulerStats(
            num_total_blocks=pool.num_blocks,
            block_size=self.config.block_size,
            num_free_blocks=pool.num_free_blocks,
            num_evictable_blocks=pool.num_evictable_blocks,
            num_running_prefill=len(self._prefilling),
            num_running_decode=len(self._decoding),
            num_waiting=len(self._waiting),
            num_offloaded=preemption.num_live_offloading() + len(preemption.offloaded)
            + preemption.num_live_resuming(),
            new_token_ratio=self.reservation.new_token_ratio,
            num_preemptions_offload=preemption.num_preemptions_offload,
            num_preemptions_recompute=preemption.num_preemptions_recompute,
            num_offload_failures=preemption.num_offload_failures,
            num_restore_failures=preemption.num_restore_failures,
            num_recomputed_tokens=self._num_recomputed_tokens,
            num_finished=self._num_finished,
            bytes_offloaded=preemption.bytes_offloaded,
            bytes_restored=preemption.bytes_restored,
            num_steps=self._step_id,
            cache_available=preemption.has_capacity_report,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
        )

    def check_integrity(self) -> None:
        """States the invariants; raises IntegrityError naming the first one broken.

        O(pool + requests): call it in tests and when idle, not every step.
        """
        preemption = self._preemption
        queues = {
            "waiting": list(self._waiting),
            "prefilling": self._prefilling,
            "decoding": self._decoding,
            "offloaded": preemption.offloaded,
            "offloading": list(preemption.offloading.values()),
            "resuming": list(preemption.resuming.values()),
        }
        check_requests(self.config, queues, self._requests)
        holders = chain(self._prefilling, self._decoding, preemption.offloading.values(),
                        preemption.resuming.values())
        self.kv.pool.check_integrity(r.block_ids for r in holders)
        ratio = self.reservation.new_token_ratio
        if not 0 <= ratio <= self.config.init_new_token_ratio:
            raise IntegrityError(f"new_token_ratio {ratio} outside [0, init]")
        num_running = self._num_running()
        if num_running > self.config.max_num_seqs:
            raise IntegrityError(
                f"{num_running} requests running, max_num_seqs is {self.config.max_num_seqs}"
            )
