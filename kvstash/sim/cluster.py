"""Instances of the real scheduler core, stepped in virtual time.

Each instance is `scheduler_svc.core.Scheduler`, unchanged, with its clock
reading the simulation's time. What the engine (scheduler_svc/engine.py)
would await, the simulation turns into events on one heap:

    arrival     -> routed to an instance: add_request
    step done   -> observe_step, update (each sampling seq gets a token)
    copy done   -> finish_offload / finish_restore
    then every instance the events touched and that is not mid-step is
    woken as the engine's loop is: schedule(); its copies start; its step
    runs for the profile's seconds, or it waits for the next event.

Copies run as the engine's copy tasks do, beside the steps but for their
gathers and scatters, which queue with the steps on the instance's worker
compute thread (worker.py); the cache tier (cache.py) holds snapshots
within its host budget, spills to disk within the disk budget, and refuses
beyond (the core then recomputes, as with a real refusal). P/D pools:
pd.py, on the same heap.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvstash.common.sampling import SamplingParams
from kvstash.errors import KvstashError
from kvstash.sim.cache import SimCache
from kvstash.sim.profile import CostProfile
from kvstash.sim.routers import ROUTERS
from kvstash.sim.worker import SimWorker
from kvstash.workload.metrics import RequestRecord
from kvstash.workload.trace import Trace, TraceRequest
from scheduler_svc.core.config import POLICIES, SchedulerConfig
from scheduler_svc.core.outputs import (
    Counters,
    OffloadCommand,
    RequestUpdate,
    RestoreCommand,
    SchedulerOutput,
)
from scheduler_svc.core.scheduler import Scheduler

TOKEN = 0  # what every simulated sample draws (the sim's configs stop on no token)
VOCAB = 1 << 32  # prompt tokens number a trace's hash ids (prompt_of)
SAMPLE_EVERY_S = 0.5  # virtual seconds between occupancy samples


@dataclass(slots=True)
class Instance:
    name: str
    core: Scheduler
    worker: SimWorker
    block_bytes: int  # KV bytes of one of its blocks (of its block_size, not the profile's)
    stepping: bool = False
    held: set[str] = field(default_factory=set)  # request ids routed here, not ended
    routed: int = 0  # requests routed here


# A put's landing: (instance, command, bytes or None, seconds or None) -> the instance to wake.
Landed = Callable[[Instance, OffloadCommand, int | None, float | None], Instance]


@dataclass(slots=True)
class Sample:
    """The cluster at one step's end, for occupancy plots."""

    t: float
    pool_used: float  # the instances' KV pools held by requests, [0, 1]
    host_bytes: int
    disk_bytes: int


def instance_configs(policy: str, instances: int, *, prefix: str = "i", **settings: Any
                     ) -> list[SchedulerConfig]:
    """One SchedulerConfig per instance under a named policy (the core's
    POLICIES), the other `settings` as given; snapshot ids kept apart."""
    mode, reservation = POLICIES[policy]
    return [SchedulerConfig(vocab_size=VOCAB, preemption_mode=mode,
                            reservation_policy=reservation, snapshot_id_prefix=f"{prefix}{n}",
                            **settings) for n in range(instances)]


def sampling_of(request: TraceRequest) -> SamplingParams:
    return SamplingParams(max_tokens=request.output_length, ignore_eos=True)


def prompt_of(request: TraceRequest, block_tokens: int, tokens: dict[int, int]) -> list[int]:
    """Tokens that share exactly what the request's hash ids share: each trace
    block one token, repeated (the core hashes its blocks chained: a run of
    equal tokens is no false match), numbered in `tokens` as its hash id is
    first seen (ids may pass the core's 32-bit tokens). No text."""
    prompt: list[int] = []
    for hash_id in request.hash_ids:
        prompt += [tokens.setdefault(hash_id, len(tokens))] * block_tokens
    return prompt[:request.input_length]


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    counters: dict[str, int]  # summed over instances
    samples: list[Sample]
    end_s: float  # virtual time the last event happened


class Cluster:
    def __init__(self, configs: Sequence[SchedulerConfig], profile: CostProfile,
                 cache: SimCache, transport: str = "arena", router: str = "round-robin"
                 ) -> None:
        """One instance per config, all sharing `cache`."""
        if any(config.prefix_segment_blocks for config in configs):
            raise ValueError("the simulation has no prefix tier: prefix_segment_blocks must "
                             "be 0")
        self.now = 0.0
        self.profile = profile
        self.cache = cache
        self.instances = [Instance(f"i{n}", Scheduler(config, clock=lambda: self.now),
                                   SimWorker(profile, transport),
                                   profile.block_bytes(config.block_size))
                          for n, config in enumerate(configs)]
        for inst in self.instances:
            inst.core.set_cache_available(True)
        self.front = self.instances  # where arrivals are routed
        self.route = ROUTERS[router]()
        self.block_tokens = 1  # the trace's, once run
        self.tokens: dict[int, int] = {}  # each hash id's token (prompt_of)
        self._next_sample_s = 0.0
        self._ended = 0  # requests finished or refused
        self._events: list[tuple[float, int, Callable[[], Instance | None]]] = []
        self._order = itertools.count()
        self.records: list[RequestRecord] = []
        self.samples: list[Sample] = []

    def pool_used(self) -> float:
        """The share of all instances' KV pools requests hold (not free, not evictable)."""
        held = total = 0
        for inst in self.instances:
            pool = inst.core.kv.pool
            held += pool.num_blocks - pool.num_free_blocks - pool.num_evictable_blocks
            total += pool.num_blocks
        return held / total

    def at(self, t: float, action: Callable[[], Instance | None]) -> None:
        heapq.heappush(self._events, (t, next(self._order), action))

    def run(self, trace: Trace, progress: Callable[[int], None] | None = None) -> SimResult:
        """Serves `trace`; `progress` hears how many more requests ended after
        each instant."""
        self.block_tokens = trace.block_tokens
        self.records = [RequestRecord(i, r.arrival_s) for i, r in enumerate(trace.requests)]
        for i, request in enumerate(trace.requests):
            self.at(request.arrival_s, functools.partial(self._arrive, i, request))
        reported = 0
        while self._events:
            t = self._events[0][0]
            self.now = t
            woken: dict[str, Instance] = {}
            while self._events and self._events[0][0] == t:
                inst = heapq.heappop(self._events)[2]()
                if inst is not None:
                    woken[inst.name] = inst
            for inst in woken.values():
                if not inst.stepping:
                    self._wake(inst)
            if progress is not None and self._ended > reported:
                progress(self._ended - reported)
                reported = self._ended
        for inst in self.instances:
            inst.core.check_integrity()
        if stalled := [i for i, r in enumerate(self.records) if r.ended_s is None]:
            raise AssertionError(f"requests {stalled[:8]} never ended: no event was left "
                                 f"to wake the instance holding them")
        counters: dict[str, int] = {}
        for inst in self.instances:
            for key, value in counters_of(inst.core).items():
                counters[key] = counters.get(key, 0) + value
        return SimResult(self.records, counters, self.samples, self.now)

    # -- events ---------------------------------------------------------------

    def _arrive(self, index: int, request: TraceRequest) -> Instance | None:
        inst = self.route(self.front, request)
        inst.routed += 1
        return self._admit(inst, index, prompt_of(request, self.block_tokens, self.tokens),
                           sampling_of(request))

    def _admit(self, inst: Instance, index: int, prompt: list[int], sampling: SamplingParams,
               handoff: bool = False) -> Instance | None:
        """add_request on `inst`: the instance to wake, or None where it refused."""
        try:
            inst.core.add_request(str(index), prompt, sampling, handoff=handoff)
        except KvstashError as exc:
            self._refused(index, exc)
            return None
        inst.held.add(str(index))
        return inst

    def _refused(self, index: int, exc: KvstashError) -> None:
        self.records[index].error = type(exc).__name__
        self.records[index].ended_s = self.now
        self._ended += 1

    def _wake(self, inst: Instance) -> None:
        out = inst.core.schedule()
        if out.seqs:  # the step reaches the compute thread before this schedule's copies
            inst.stepping = True
            end = inst.worker.run(self.now, self.profile.step.seconds(out.seqs, out.num_decodes))
            seconds = end - self.now  # what the engine measures: queued work included
            self.at(end, lambda: self._stepped(inst, out, seconds))
        for offload in out.offloads:
            self._offload(inst, offload)
        for restore in out.restores:
            self._restore(inst, restore)
        for handoff in out.handoffs:  # P/D prefill instances only
            self._hand_off(inst, handoff)
        for snapshot_id in inst.core.take_snapshots_to_delete():
            self.cache.delete(snapshot_id)

    def _stepped(self, inst: Instance, out: SchedulerOutput, seconds: float) -> Instance:
        inst.stepping = False
        core = inst.core
        core.observe_step(out, seconds)
        sampled = {seq.request_id: TOKEN for seq in out.seqs if seq.sample}
        for update in core.update(out, sampled):
            record = self.records[int(update.request_id)]
            record.chunk_times.append(self.now)
            record.num_tokens += len(update.new_token_ids)
            if update.finish_status is not None:
                record.ended_s = self.now
                inst.held.discard(update.request_id)
                self._ended += 1
                self._finished(inst, update)
        if self.now >= self._next_sample_s:  # one sample per SAMPLE_EVERY_S at most
            self._next_sample_s = self.now + SAMPLE_EVERY_S
            self.samples.append(Sample(self.now, self.pool_used(), self.cache.used["host"],
                                       self.cache.used["disk"]))
        return inst

    def _hand_off(self, inst: Instance, cmd: OffloadCommand) -> None:
        """A prefilled request's KV, out to its decode instance (kvstash.sim.pd)."""
        raise AssertionError("only a P/D prefill instance hands requests off")

    def _finished(self, inst: Instance, update: RequestUpdate) -> None:
        """A request finished on `inst` (its record is closed)."""

    def _offload(self, inst: Instance, cmd: OffloadCommand) -> None:
        self._put(inst, cmd, self._offloaded)

    def _put(self, inst: Instance, cmd: OffloadCommand, done: Landed) -> None:
        """A snapshot's copy into the cache (an offload or a hand-off): `done`
        hears its bytes and seconds once it lands, or None twice once the cache
        refused it."""
        num_bytes = len(cmd.block_ids) * inst.block_bytes
        tier = self.cache.put(cmd.snapshot_id, num_bytes)
        if tier is None:  # refused: the copy fails once the cache answers
            self.at(self.now + self.profile.copy[inst.worker.transport].fixed_s,
                    lambda: done(inst, cmd, None, None))
            return
        gather, beside = inst.worker.copy_seconds(tier, num_bytes)
        landed = inst.worker.run(self.now, gather) + beside
        seconds = landed - self.now
        self.at(landed, lambda: done(inst, cmd, num_bytes, seconds))

    def _offloaded(self, inst: Instance, cmd: OffloadCommand, num_bytes: int | None,
                   seconds: float | None) -> Instance:
        inst.core.finish_offload(cmd, num_bytes, seconds)
        return inst

    def _restore(self, inst: Instance, cmd: RestoreCommand) -> None:
        """Fetched beside the steps, then scattered on the compute thread."""
        tier = self.cache.tier(cmd.snapshot_id)
        num_bytes = len(cmd.block_ids) * inst.block_bytes
        scatter, fetch = inst.worker.copy_seconds(tier, num_bytes)
        got = None if tier is None else num_bytes
        started = self.now

        def fetched() -> None:
            landed = inst.worker.run(self.now, scatter)
            self.at(landed, lambda: self._restored(inst, cmd, got, landed - started))

        self.at(self.now + fetch, fetched)

    def _restored(self, inst: Instance, cmd: RestoreCommand, num_bytes: int | None,
                  seconds: float) -> Instance:
        inst.core.finish_restore(cmd, num_bytes, seconds if num_bytes is not None else None)
        if num_bytes is not None:
            self.cache.delete(cmd.snapshot_id)  # a restore consumes its snapshot
        return inst


def counters_of(core: Scheduler) -> dict[str, int]:
    """The core's counters (not its gauges), by name."""
    stats = core.stats()
    return {f.name: getattr(stats, f.name) for f in fields(Counters)}
