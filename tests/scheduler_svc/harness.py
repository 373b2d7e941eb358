"""Drives a Scheduler with a FakeWorker and FakeTransport, checking invariants each step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvstash.common.sampling import SamplingParams
from kvstash.errors import NotFound
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from tests.scheduler_svc.fakes import FakeTransport, FakeWorker, reference_output


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True)
class AbortPlan:
    step: int
    # Index into the arrivals; aborts it if it is still unfinished then.
    index: int
    # Abort between schedule() and update() instead of before schedule().
    mid_step: bool


@dataclass
class Outcome:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_statuses: dict[str, RequestStatus] = field(default_factory=dict)
    num_steps: int = 0
    num_preemptions: int = 0


class Harness:
    def __init__(
        self,
        config: SchedulerConfig,
        seed: int = 0,
        fail_rate: float = 0.0,
        max_delay: int = 3,
        capacity_choices: tuple[int | None, ...] = (10**12,),
        abort_statuses: frozenset[RequestStatus] = frozenset(),
        abort_rate: float = 0.0,
    ) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.rng = random.Random(seed)
        self.worker = FakeWorker(config.num_blocks, config.block_size, config.vocab_size)
        self.transport = FakeTransport(
            self.worker, self.rng, max(config.bytes_per_block, 1), fail_rate, max_delay
        )
        # Bytes the fake cache accepts, None = down; re-drawn now and then.
        self.capacity_choices = capacity_choices
        self.transport.capacity_bytes = capacity_choices[0]
        self.scheduler.set_cache_available(capacity_choices[0] is not None)
        # Each step, each request in one of these states is aborted with this chance.
        self.abort_statuses = abort_statuses
        self.abort_rate = abort_rate
        self.truth: dict[str, list[int]] = {}
        self.outcome = Outcome()
        self.unfinished: set[str] = set()

    def _abort(self, request_id: str) -> None:
        if request_id not in self.unfinished:
            return
        self.scheduler.abort(request_id)
        self.unfinished.discard(request_id)
        self.outcome.finish_statuses[request_id] = RequestStatus.FINISHED_ABORTED

    def _random_aborts(self) -> None:
        for rid in sorted(self.unfinished):
            req = self.scheduler.get_request(rid)
            assert req is not None
            if req.status in self.abort_statuses and self.rng.random() < self.abort_rate:
                self._abort(rid)

    def step(self, step: int, mid_step_aborts: list[str]) -> None:
        sched = self.scheduler
        if self.abort_rate:
            self._random_aborts()
        before = {rid: sched.get_request(rid) for rid in self.unfinished}
        statuses = {rid: r.status for rid, r in before.items() if r is not None}
        output = sched.schedule()
        # No prefill is ever preempted; at least one decode keeps running.
        for rid, status in statuses.items():
            req = before[rid]
            assert req is not None
            if status is RequestStatus.RUNNING_PREFILL:
                assert req.status is RequestStatus.RUNNING_PREFILL, f"prefill {rid} preempted"
        num_decode_before = sum(1 for s in statuses.values() if s is RequestStatus.RUNNING_DECODE)
        num_decode_after = sum(
            1 for r in before.values() if r is not None and r.status is RequestStatus.RUNNING_DECODE
        )
        if num_decode_before:
            assert num_decode_after >= 1, "every decode request was preempted"
        ids = [seq.request_id for seq in output.seqs]
        assert len(ids) == len(set(ids)), f"duplicated in one step: {ids}"
        assert output.num_scheduled_tokens <= self.config.max_num_batched_tokens
        self.transport.check_not_busy(output)
        self.transport.submit(output, step)
        sampled = self.worker.execute(output, self.truth)
        for rid in mid_step_aborts:
            self._abort(rid)
        for update in sched.update(output, sampled):
            assert update.request_id in self.unfinished
            self.truth[update.request_id].extend(update.new_token_ids)
            self.outcome.outputs[update.request_id].extend(update.new_token_ids)
            if update.finish_status is not None:
                self.unfinished.discard(update.request_id)
                self.outcome.finish_statuses[update.request_id] = update.finish_status
        self.transport.tick(sched, step, self.truth)
        if self.rng.random() < 0.2:
            capacity = self.rng.choice(self.capacity_choices)
            self.transport.capacity_bytes = capacity
            sched.set_cache_available(capacity is not None)
        self.transport.delete(sched.take_snapshots_to_delete())
        sched.check_integrity()
        for rid in self.unfinished:
            req = sched.get_request(rid)
            assert req is not None and not req.status.is_finished, f"request {rid} lost"
            assert req.output_token_ids == self.outcome.outputs[rid]

    def run(
        self, arrivals: list[Arrival], aborts: list[AbortPlan] = (), max_steps: int = 20_000
    ) -> Outcome:  # type: ignore[assignment]
        sched = self.scheduler
        by_step: dict[int, list[Arrival]] = {}
        for arrival in arrivals:
            by_step.setdefault(arrival.step, []).append(arrival)
        aborts_by_step: dict[int, list[AbortPlan]] = {}
        for plan in aborts:
            aborts_by_step.setdefault(plan.step, []).append(plan)
        last_event = max([a.step for a in arrivals] + [p.step for p in aborts] + [0])
        step = 0
        while step <= last_event or self.unfinished or not sched.is_idle or (
            self.transport.in_flight
        ):
            assert step < max_steps, f"no progress after {step} steps: {sorted(self.unfinished)}"
            for arrival in by_step.get(step, []):
                req = sched.add_request(arrival.request_id, arrival.prompt, arrival.sampling)
                assert req.prompt_token_ids == arrival.prompt
                self.truth[arrival.request_id] = list(arrival.prompt)
                self.outcome.outputs[arrival.request_id] = []
                self.unfinished.add(arrival.request_id)
            mid_step = []
            for plan in aborts_by_step.get(step, []):
                rid = arrivals[plan.index].request_id
                if plan.mid_step:
                    mid_step.append(rid)
                else:
                    self._abort(rid)
            self.step(step, mid_step)
            step += 1
        self.outcome.num_steps = step
        self._check_end(arrivals)
        return self.outcome

    def _check_end(self, arrivals: list[Arrival]) -> None:
        sched = self.scheduler
        pool = sched.kv.pool
        assert pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks, "blocks leak"
        assert not self.transport.snapshots, f"undeleted {sorted(self.transport.snapshots)}"
        assert sched.take_snapshots_to_delete() == []
        stats = sched.stats()
        assert stats.num_finished == len(arrivals)
        assert stats.num_running_decode == stats.num_running_prefill == stats.num_waiting == 0
        assert stats.num_offloaded == 0
        outputs = self.outcome.outputs
        assert stats.num_generation_tokens == sum(len(o) for o in outputs.values())
        assert stats.num_prompt_tokens == sum(
            len(a.prompt) for a in arrivals if outputs[a.request_id])
        self.outcome.num_preemptions = (
            stats.num_preemptions_offload + stats.num_preemptions_recompute
        )
        for arrival in arrivals:
            rid = arrival.request_id
            with_abort = self.outcome.finish_statuses[rid] is RequestStatus.FINISHED_ABORTED
            expected = reference_output(
                arrival.prompt, arrival.sampling, self.config.eos_token_ids, self.config.vocab_size
            )
            got = self.outcome.outputs[rid]
            if with_abort:
                assert got == expected[: len(got)], f"{rid}: {got} is no prefix of {expected}"
            else:
                assert got == expected, f"{rid}: generated {got}, unpressured run gives {expected}"
            try:
                sched.abort(rid)
            except NotFound:
                pass
            else:
                raise AssertionError(f"finished request {rid} could still be aborted")
