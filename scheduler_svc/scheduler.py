"""Scheduler: admission, batching, preemption and offload/resume orchestration.

One step, in order:

    1. preempt   if running decodes need more blocks than are free (counting
                 blocks of snapshots already in flight as soon free), preempt
                 RUNNING_DECODE victims: shortest output, then longest prompt;
                 one decode always keeps running. Offload or recompute each.
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

import bisect
import re
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from itertools import chain

from kvstash.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from scheduler_svc.block_pool import IntegrityError
from scheduler_svc.config import PreemptionMode, SchedulerConfig
from scheduler_svc.invariants import check_requests
from scheduler_svc.kv_manager import KVCacheManager
from scheduler_svc.outputs import (
    OffloadCommand,
    RequestUpdate,
    RestoreCommand,
    ScheduledSeq,
    SchedulerOutput,
    SchedulerStats,
)
from scheduler_svc.request import Request, RequestStatus, SamplingParams, Snapshot
from scheduler_svc.reservation import Reservation

_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]")

WAITING = RequestStatus.WAITING
RUNNING_PREFILL = RequestStatus.RUNNING_PREFILL
RUNNING_DECODE = RequestStatus.RUNNING_DECODE
OFFLOADING = RequestStatus.OFFLOADING
OFFLOADED = RequestStatus.OFFLOADED
RESUMING = RequestStatus.RESUMING
FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size)
        self.reservation = Reservation(config)
        self._clock = clock
        # Every unfinished request, plus aborted ones whose copy is in flight.
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._prefilling: list[Request] = []
        self._decoding: list[Request] = []
        # OFFLOADED, in arrival order.
        self._offloaded: list[Request] = []
        # Offload / restore copies in flight (aborted requests included).
        self._offloading: dict[str, Request] = {}
        self._resuming: dict[str, Request] = {}
        self._snapshots_to_delete: list[str] = []
        self._offload_capacity: int | None = None
        # Estimated bytes of offloads in flight, and bytes committed since the
        # engine last reported capacity: both already taken from that report.
        self._offload_bytes_in_flight = 0
        self._offload_bytes_since_report = 0
        self._num_arrivals = 0
        self._num_snapshots = 0
        self._step_id = 0
        self._updated_step_id = 0
        # The requests behind the latest output's seqs, in the same order.
        self._scheduled: list[Request] = []
        self._num_preemptions_offload = 0
        self._num_preemptions_recompute = 0
        self._num_offload_failures = 0
        self._num_restore_failures = 0
        self._num_recomputed_tokens = 0
        self._num_finished = 0
        self._bytes_offloaded = 0
        self._bytes_restored = 0

    # ----------------------------------------------------------------- intake

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Request:
        config = self.config
        prompt = tuple(prompt_token_ids)
        if not prompt:
            raise InvalidArgument(f"request {request_id}: prompt is empty")
        if sampling.max_tokens <= 0:
            raise InvalidArgument(
                f"request {request_id}: max_tokens must be positive, got {sampling.max_tokens}"
            )
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1 or sampling.top_k < 0:
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
        num_blocks = self.kv.num_blocks_for(num_total)
        if num_blocks > config.num_blocks:
            raise InvalidArgument(
                f"request {request_id}: {num_total} tokens need {num_blocks} blocks, the whole "
                f"pool has {config.num_blocks} ({config.num_blocks * config.block_size} tokens)"
            )
        if request_id in self._requests:
            raise AlreadyExists(f"request {request_id} already exists")
        req = Request.create(
            request_id,
            prompt,
            sampling,
            arrival_time=self._clock(),
            arrival_seq=self._num_arrivals,
            eos_token_ids=config.eos_token_ids,
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
        scheduled: list[Request] = []
        self._scheduled = scheduled
        add_seq = seqs.append
        add_scheduled = scheduled.append
        block_size = config.block_size
        kv = self.kv
        for req in self._decoding:
            num_computed = req.num_computed_tokens
            block_ids = req.block_ids
            if num_computed >= len(block_ids) * block_size and kv.allocate_slots(req, 1) is None:
                continue  # its block comes from a snapshot copy still in flight
            add_seq(ScheduledSeq(
                req.request_id, [req.output_token_ids[-1]], num_computed, block_ids, True,
                req.sampling,
            ))
            add_scheduled(req)
        budget = config.max_num_batched_tokens - len(seqs)

        if not preempted and self._offloaded:
            self._resume(out)
        for req in self._prefilling:
            if budget == 0:
                break
            budget -= self._schedule_chunk(req, budget, seqs)
        if not preempted and not self._offloaded and not self._num_live_offloading():
            budget = self._admit(budget, seqs)
        out.num_scheduled_tokens = config.max_num_batched_tokens - budget
        return out

    def _preempt_for_decodes(self, out: SchedulerOutput) -> bool:
        """Preempts decode requests until every running decode can get its block."""
        decoding = self._decoding
        pool = self.kv.pool
        if pool.num_allocatable_blocks >= len(decoding):
            return False
        block_size = self.config.block_size
        num_needed = sum(1 for r in decoding if r.num_computed_tokens >= len(r.block_ids) * block_size)
        num_soon_free = sum(self.kv.num_exclusive_blocks(r) for r in self._offloading.values())
        if num_needed <= pool.num_allocatable_blocks + num_soon_free:
            return False
        victims = sorted(decoding, key=lambda r: (len(r.output_token_ids), -r.num_prompt_tokens))
        num_left = len(decoding)
        for victim in victims:
            if num_left == 1 or num_needed <= pool.num_allocatable_blocks + num_soon_free:
                break
            if victim.num_computed_tokens >= len(victim.block_ids) * block_size:
                num_needed -= 1
            if self._preempt(victim, out):
                num_soon_free += self.kv.num_exclusive_blocks(victim)
            num_left -= 1
        if num_left == len(decoding):
            return False
        self._decoding = [r for r in decoding if r.status is RUNNING_DECODE]
        self.reservation.on_preemption(self._decoding)
        return True

    def _preempt(self, victim: Request, out: SchedulerOutput) -> bool:
        """Offloads or recomputes one decode request; True if its blocks stay held."""
        victim.num_preemptions += 1
        num_blocks = self.kv.num_blocks_for(victim.num_computed_tokens)
        num_bytes = num_blocks * self.config.bytes_per_block
        if not self._should_offload(num_bytes):
            self._num_preemptions_recompute += 1
            self._to_recompute(victim)
            return False
        self._num_preemptions_offload += 1
        snapshot_id = f"{_UNSAFE_ID_CHARS.sub('_', victim.request_id)[:64]}-{self._num_snapshots}"
        self._num_snapshots += 1
        victim.snapshot = Snapshot(snapshot_id, victim.num_computed_tokens, num_blocks)
        victim.status = OFFLOADING
        self._offloading[victim.request_id] = victim
        self._offload_bytes_in_flight += num_bytes
        out.offloads.append(OffloadCommand(
            victim.request_id, snapshot_id, victim.block_ids[:num_blocks],
            victim.num_computed_tokens,
        ))
        return True

    def _should_offload(self, num_bytes: int) -> bool:
        mode = self.config.preemption_mode
        if mode is PreemptionMode.RECOMPUTE:
            return False
        if mode is PreemptionMode.OFFLOAD:
            return True
        if self._offload_capacity is None:
            return False
        spent = self._offload_bytes_in_flight + self._offload_bytes_since_report
        return num_bytes <= self._offload_capacity - spent

    def _to_recompute(self, req: Request) -> None:
        """Drops req's KV and queues it at the front of WAITING, output kept."""
        if req.block_ids:
            self.kv.free(req)
        req.recompute_until = max(req.recompute_until, req.num_computed_tokens)
        req.num_computed_tokens = 0
        req.snapshot = None
        req.status = WAITING
        self._waiting.appendleft(req)

    def _headroom_blocks(self) -> int:
        """Blocks the running decodes may claim soon: their reservation plus one step each."""
        decoding = self._decoding
        return (
            self.reservation.total_reserved_blocks(decoding)
            + self.config.resume_headroom * len(decoding)
        )

    def _resume(self, out: SchedulerOutput) -> None:
        pool = self.kv.pool
        num_running = self._num_running()
        headroom = self._headroom_blocks()
        while self._offloaded and num_running < self.config.max_num_seqs:
            req = self._offloaded[0]
            snapshot = req.snapshot
            assert snapshot is not None
            if pool.num_allocatable_blocks < snapshot.num_blocks + headroom:
                return
            block_ids = self.kv.allocate_fresh(req, snapshot.num_blocks)
            assert block_ids is not None
            del self._offloaded[0]
            req.status = RESUMING
            self._resuming[req.request_id] = req
            out.restores.append(RestoreCommand(req.request_id, snapshot.snapshot_id, list(block_ids)))
            headroom += self.reservation.reserved_blocks(req) + self.config.resume_headroom
            num_running += 1

    def _schedule_chunk(self, req: Request, budget: int, seqs: list[ScheduledSeq]) -> int:
        start = req.num_computed_tokens
        end = min(req.num_tokens, start + budget)
        seqs.append(ScheduledSeq(
            req.request_id, req.token_ids(start, end), start, req.block_ids,
            end == req.num_tokens, req.sampling,
        ))
        self._scheduled.append(req)
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
        # A prefill whose next chunk completes its prompt is about to decode.
        reserved = reservation.total_reserved_blocks(self._decoding) + sum(
            reservation.reserved_blocks(r) for r in self._prefilling
            if r.num_tokens - r.num_computed_tokens <= chunk_limit
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
        if output.step_id != self._step_id or self._updated_step_id == output.step_id:
            raise FailedPrecondition(
                f"output of step {output.step_id} is stale or already applied "
                f"(latest step {self._step_id})"
            )
        if len(output.seqs) != len(self._scheduled):
            raise InvalidArgument(
                f"output of step {output.step_id} has {len(output.seqs)} seqs, "
                f"{len(self._scheduled)} were scheduled"
            )
        self._updated_step_id = output.step_id
        kv = self.kv
        block_size = self.config.block_size
        clock = self._clock
        updates: list[RequestUpdate] = []
        num_prefill_done = 0
        num_finished = 0
        for seq, req in zip(output.seqs, self._scheduled):
            request_id = req.request_id
            status = req.status
            if status is RUNNING_DECODE:
                num_computed = req.num_computed_tokens
                if num_computed != seq.start_pos:
                    continue  # restored meanwhile; it was not in this step
                num_computed += 1
                req.num_computed_tokens = num_computed
                if not num_computed % block_size:
                    kv.cache_full_blocks(req)
            elif status is RUNNING_PREFILL and req.num_computed_tokens == seq.start_pos:
                self._record_chunk(req, seq)
                if not seq.sample:
                    continue
                req.recompute_until = 0
                req.status = RUNNING_DECODE
                self._decoding.append(req)
                num_prefill_done += 1
                if req.first_token_time is None:
                    req.first_token_time = clock()
            else:
                continue  # aborted (and maybe re-added) or preempted meanwhile
            try:
                token_id = sampled_token_ids[request_id]
            except KeyError:
                raise InvalidArgument(f"no sampled token for request {request_id}") from None
            output_ids = req.output_token_ids
            output_ids.append(token_id)
            if token_id in req.stop_ids:
                finish_status = RequestStatus.FINISHED_STOPPED
            elif len(output_ids) >= req.sampling.max_tokens:
                finish_status = RequestStatus.FINISHED_LENGTH
            else:
                updates.append(RequestUpdate(request_id, [token_id], None))
                continue
            self._finish(req, finish_status)
            num_finished += 1
            updates.append(RequestUpdate(request_id, [token_id], finish_status))
        if num_prefill_done:
            self._prefilling = [r for r in self._prefilling if r.status is RUNNING_PREFILL]
        if num_finished:
            self._decoding = [r for r in self._decoding if r.status is RUNNING_DECODE]
        return updates

    def _record_chunk(self, req: Request, seq: ScheduledSeq) -> None:
        start = seq.start_pos
        end = start + len(seq.token_ids)
        if start < req.recompute_until:
            num_recomputed = min(end, req.recompute_until) - start
            req.num_recomputed_tokens += num_recomputed
            self._num_recomputed_tokens += num_recomputed
        req.num_computed_tokens = end
        self.kv.cache_full_blocks(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        del self._requests[req.request_id]
        self._num_finished += 1

    # ------------------------------------------------------- engine callbacks

    def abort(self, request_id: str) -> None:
        """Finishes a request in any state; a copy in flight keeps its blocks until it lands."""
        req = self._requests.get(request_id)
        if req is None or req.status.is_finished:
            raise NotFound(f"request {request_id} is unknown or already finished")
        status = req.status
        req.status = FINISHED_ABORTED
        self._num_finished += 1
        if status is OFFLOADING or status is RESUMING:
            return  # finish_offload / finish_restore release it
        if status is WAITING:
            self._waiting.remove(req)
        elif status is RUNNING_PREFILL:
            self._prefilling.remove(req)
            self.kv.free(req)
        elif status is RUNNING_DECODE:
            self._decoding.remove(req)
            self.kv.free(req)
        elif status is OFFLOADED:
            self._offloaded.remove(req)
            self._drop_snapshot(req)
        del self._requests[request_id]

    def _drop_snapshot(self, req: Request) -> None:
        if req.snapshot is not None:
            self._snapshots_to_delete.append(req.snapshot.snapshot_id)
            req.snapshot = None

    def _take_in_flight(self, in_flight: dict[str, Request], request_id: str, what: str) -> Request:
        req = in_flight.pop(request_id, None)
        if req is not None:
            return req
        if request_id in self._requests:
            raise FailedPrecondition(
                f"request {request_id} has no {what} in flight "
                f"(status {self._requests[request_id].status.value})"
            )
        raise NotFound(f"request {request_id} is unknown")

    def finish_offload(self, request_id: str, num_bytes: int | None) -> None:
        """The snapshot is committed (num_bytes) or the copy failed (None)."""
        req = self._take_in_flight(self._offloading, request_id, "offload")
        snapshot = req.snapshot
        assert snapshot is not None
        self._offload_bytes_in_flight -= snapshot.num_blocks * self.config.bytes_per_block
        self.kv.free(req)
        if req.status is FINISHED_ABORTED:
            if num_bytes is None:
                req.snapshot = None  # a failed put leaves nothing behind
            self._drop_snapshot(req)
            del self._requests[request_id]
        elif num_bytes is None:
            self._num_offload_failures += 1
            self._to_recompute(req)
        else:
            snapshot.num_bytes = num_bytes
            req.bytes_offloaded += num_bytes
            self._bytes_offloaded += num_bytes
            self._offload_bytes_since_report += num_bytes
            req.status = OFFLOADED
            keys = [r.arrival_seq for r in self._offloaded]
            self._offloaded.insert(bisect.bisect(keys, req.arrival_seq), req)

    def finish_restore(self, request_id: str, ok: bool) -> None:
        """The snapshot is back in the request's blocks (ok) or the copy failed."""
        req = self._take_in_flight(self._resuming, request_id, "restore")
        snapshot = req.snapshot
        assert snapshot is not None
        self._drop_snapshot(req)
        if req.status is FINISHED_ABORTED:
            self.kv.free(req)
            del self._requests[request_id]
        elif ok:
            self._bytes_restored += snapshot.num_bytes
            req.status = RUNNING_DECODE
            self._decoding.append(req)
            self.kv.cache_full_blocks(req)
        else:
            self._num_restore_failures += 1
            self._to_recompute(req)

    def set_offload_capacity(self, free_bytes: int | None) -> None:
        """Free bytes the cache service reported; None = unreachable (recompute)."""
        if free_bytes is not None and free_bytes < 0:
            raise InvalidArgument(f"free_bytes must be >= 0, got {free_bytes}")
        self._offload_capacity = free_bytes
        self._offload_bytes_since_report = 0

    def take_snapshots_to_delete(self) -> list[str]:
        snapshot_ids = self._snapshots_to_delete
        self._snapshots_to_delete = []
        return snapshot_ids

    # ------------------------------------------------------------ inspection

    def _num_live_offloading(self) -> int:
        return sum(1 for r in self._offloading.values() if r.status is OFFLOADING)

    def _num_running(self) -> int:
        num_resuming = sum(1 for r in self._resuming.values() if r.status is RESUMING)
        return len(self._prefilling) + len(self._decoding) + num_resuming

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._prefilling or self._decoding or self._offloaded
                    or self._num_live_offloading() or self._num_running())

    @property
    def is_idle(self) -> bool:
        """Nothing to schedule and nothing in flight: no request of any kind held."""
        return not self._requests and not self._snapshots_to_delete

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        num_offloaded = (
            self._num_live_offloading()
            + len(self._offloaded)
            + sum(1 for r in self._resuming.values() if r.status is RESUMING)
        )
        return SchedulerStats(
            num_total_blocks=pool.num_blocks,
            block_size=self.config.block_size,
            num_free_blocks=pool.num_free_blocks,
            num_evictable_blocks=pool.num_evictable_blocks,
            num_running_prefill=len(self._prefilling),
            num_running_decode=len(self._decoding),
            num_waiting=len(self._waiting),
            num_offloaded=num_offloaded,
            new_token_ratio=self.reservation.new_token_ratio,
            num_preemptions_offload=self._num_preemptions_offload,
            num_preemptions_recompute=self._num_preemptions_recompute,
            num_offload_failures=self._num_offload_failures,
            num_restore_failures=self._num_restore_failures,
            num_recomputed_tokens=self._num_recomputed_tokens,
            num_finished=self._num_finished,
            bytes_offloaded=self._bytes_offloaded,
            bytes_restored=self._bytes_restored,
            num_steps=self._step_id,
        )

    def check_integrity(self) -> None:
        """States the invariants; raises IntegrityError naming the first one broken.

        O(pool + requests): call it in tests and when idle, not every step.
        """
        queues = {
            "waiting": list(self._waiting),
            "prefilling": self._prefilling,
            "decoding": self._decoding,
            "offloaded": self._offloaded,
            "offloading": list(self._offloading.values()),
            "resuming": list(self._resuming.values()),
        }
        check_requests(self.config, queues, self._requests)
        holders = chain(self._prefilling, self._decoding, self._offloading.values(),
                        self._resuming.values())
        self.kv.pool.check_integrity(r.block_ids for r in holders)
        ratio = self.reservation.new_token_ratio
        if not 0 <= ratio <= self.config.init_new_token_ratio:
            raise IntegrityError(f"new_token_ratio {ratio} outside [0, init]")
        if self._num_running() > self.config.max_num_seqs:
            raise IntegrityError(
                f"{self._num_running()} requests running, max_num_seqs is "
                f"{self.config.max_num_seqs}"
            )
