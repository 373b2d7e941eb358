"""The step loop: drives the scheduler core against one worker.

One asyncio task owns the core. Every core call is synchronous and short; all
I/O is awaited outside the core, so nothing is held across I/O and a slow
copy never stalls the steps of other requests.

    core.schedule() --> StepStream.step() --> core.update() --> request streams
        +-- offloads / restores, prefix-tier loads / saves (copies.py),
            hand-offs (handoff.py, a P/D prefill instance only): their own
            tasks; each outcome goes back into the core and wakes the loop

One record per in-flight request (inflight.py), made when the core takes it
and dropped when the core lets go of it (`_end`). A lost worker fails the
requests whose state it held; the others wait for it, within a bound
(`_lose_worker`, worker_watch.py); a bug (anything else raised in the loop or
a task beside it) ends every request and the engine (`_fail_for_good`),
for the process to exit and be restarted. A prefill instance has a PrefillSide, a
decode instance a DecodeSide; a mixed one neither, and never enters P/D
code. Every step's wall time goes back
into the core (`observe_step`) for its cost model; each preemption is a
"preempted" event on the request's trace and a count by mode and reason.
With EngineConfig.tracing each request keeps the trace context it was
submitted in (kvstash.common.telemetry): its copies' spans and its phases
join its trace.

Why one file over 300 lines: the loop and what it must keep in step with
(requests taken and ended, the worker up, lost or given up on, the loop's
own failure, the integrity check when idle) are one piece; what runs beside the loop (copies,
hand-offs) has its own modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from kvstash import errors
from kvstash.common.sampling import SamplingParams
from kvstash.errors import IntegrityError
from scheduler_svc import tracing
from scheduler_svc.cache_link import CacheLink
from scheduler_svc.copies import Copies
from scheduler_svc.core.config import Role
from scheduler_svc.core.kv_events import KvEvent
from scheduler_svc.core.outputs import Preempted, RequestUpdate
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.decode_peers import DecodePeers
from scheduler_svc.handoff import DecodeSide, PrefillSide
from scheduler_svc.inflight import InFlightRequests, Tasks
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.streams import RequestStream
from scheduler_svc.worker_link import STEP_TIMEOUT_S, StepStream, WorkerLink
from scheduler_svc.worker_watch import WorkerWatch

log = logging.getLogger(__name__)

# How a scheduler run with EngineConfig.check_integrity exits on a broken invariant.
INTEGRITY_EXIT_CODE = 70
# At close, how long the last snapshot deletes may take (the cache's TTL
# takes what they leave).
CLOSE_DELETES_S = 5.0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # One offload or restore, end to end: the worker bounds its cache calls by it.
    transfer_timeout_s: float = 60.0
    # One prefix-tier save, or a load's reads (copies.py): bounded apart, and
    # short. The copy is optional (a segment not loaded is prefilled, one not
    # saved is sent again by the next prompt), yet a load holds its request
    # LOADING and a save pins blocks other requests wait for, as long as a
    # cache that hangs keeps them (its watcher sees it only once a probe
    # times out). A load may also take as long as the prefill it saves is
    # predicted to.
    prefix_copy_timeout_s: float = 2.0
    # Emit phase and transfer spans (kvstash.common.telemetry is on). Off, the step
    # loop builds no span data at all.
    tracing: bool = False
    # Check every invariant of the core (O(pool + requests)) whenever the loop
    # goes idle, and exit the process on a broken one: for tests.
    check_integrity: bool = False
    # How long requests that need nothing from a lost worker (waiting, or
    # offloaded to the cache) wait for it to come back before they fail
    # UNAVAILABLE, counted from the loss; 0: they fail with it.
    worker_reconnect_s: float = 30.0
    # One step, or opening a stream, past which the worker counts as lost (a
    # hung device or compute thread, behind a gRPC server that still answers).
    step_timeout_s: float = STEP_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0 <= self.worker_reconnect_s < math.inf:
            raise ValueError("worker_reconnect_s must be a finite number of seconds >= 0, "
                             f"got {self.worker_reconnect_s}")
        for name in ("transfer_timeout_s", "prefix_copy_timeout_s", "step_timeout_s"):
            if not 0 < (seconds := getattr(self, name)) < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {seconds}")


class Engine:
    def __init__(
        self, core: Scheduler, worker: WorkerLink, cache: CacheLink | None,
        config: EngineConfig = EngineConfig(), *, metrics: SchedulerMetrics | None = None,
        on_worker_change: Callable[[bool], Awaitable[None]] | None = None,
        decode_peers: DecodePeers | None = None,
        kv_events: Callable[[list[KvEvent]], None] | None = None,
    ) -> None:
        """`on_worker_change(True)` is awaited once the worker answers and an
        Execute stream is open, `(False)` once that stream broke.
        `decode_peers`: where a prefill instance hands off (that role, which
        the core's config names, only).
        `kv_events`: told the prefix cache's changes after every step."""
        role = core.config.role
        if (role is Role.PREFILL) != (decode_peers is not None):
            raise ValueError(f"role {role.value}: decode_peers are for a prefill instance, and "
                             "one needs them")
        self.role = role
        self._core = core
        self._worker = worker
        self._config = config
        self._metrics = metrics
        self._watch = WorkerWatch(worker, config.worker_reconnect_s, on_worker_change)
        self._wake = asyncio.Event()
        self._requests = requests = InFlightRequests(config.tracing)
        self._tasks = tasks = Tasks(self._task_failed)
        self._cache = cache
        wake = self._wake.set
        self._copies = copies = Copies(
            core, worker, cache, requests, tasks, wake, metrics=metrics,
            transfer_timeout_s=config.transfer_timeout_s,
            prefix_copy_timeout_s=config.prefix_copy_timeout_s)
        self._kv_events = kv_events
        if kv_events is not None:
            core.record_kv_events()
        self._prefill = None if decode_peers is None else PrefillSide(
            core, decode_peers, copies, requests, tasks, wake, metrics)
        self._decode = DecodeSide(core, copies, requests, tasks, wake) if (
            role is Role.DECODE) else None
        # The bug that broke the step loop, if one did (_fail_for_good), and
        # the first a task beside it raised, for the loop to raise.
        self.failure: Exception | None = None
        self._task_failure: RuntimeError | None = None
        self._failed = asyncio.Event()

    @property
    def core(self) -> Scheduler:
        return self._core

    @property
    def worker_up(self) -> bool:
        """An Execute stream to a live worker is open: requests can run."""
        return self._watch.up

    async def wait_until_worker_up(self) -> None:
        await self._watch.wait_up()

    async def wait_failed(self) -> Exception:
        """Returns once a bug broke the step loop (never otherwise): the core's
        state can no longer be trusted, and the process should exit and be
        restarted."""
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    async def start(self) -> None:
        self._tasks.spawn(self._run(), name="step-loop")
        if self._cache is not None:
            self._tasks.spawn(self._cache.watch(self._core.set_cache_available))

    async def close(self) -> None:
        """Stops the step loop and every copy; then sends the snapshot deletes
        queued by then (the requests a shutdown aborted, the copies it cut
        off), within CLOSE_DELETES_S: those snapshots leave the cache now,
        not after their TTL."""
        await self._tasks.close()
        self._copies.delete_snapshots(self._core.take_snapshots_to_delete())
        await self._copies.deletes.close(grace_s=CLOSE_DELETES_S)

    # -- requests -------------------------------------------------------------

    async def admit(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> RequestStream:
        """Admits a request (raises InvalidArgument / AlreadyExists /
        ResourceExhausted; Unavailable while the worker is given up on) and
        returns the stream its tokens arrive on. One aborted meanwhile (while
        the prefix tier is asked) is never submitted: its stream holds its
        end only. A prefill instance hands off what has more than one token
        to decode (a decode instance is found once its KV is copied out)."""
        self._check_admission()
        self._core.check_request(request_id, prompt_token_ids, sampling)
        with self._requests.admitting(request_id) as admission:
            hashes = self._core.prompt_block_hashes(prompt_token_ids)  # once, kept by the core
            stored = await self._stored_segments(hashes)
        if admission.aborted:  # meanwhile
            return RequestStream.aborted_unadmitted(request_id, len(prompt_token_ids))
        if self._prefill is None or not self._prefill.hands_off(sampling):
            return self.submit(request_id, prompt_token_ids, sampling, stored, hashes)
        self._check_admission()  # the engine may have failed meanwhile
        stream = self._prefill.submit(request_id, prompt_token_ids, sampling, stored, hashes)
        self._wake.set()
        return stream

    def _check_admission(self) -> None:
        """Unavailable while the worker is given up on, or for good once the
        step loop failed."""
        if self.failure is not None:
            raise errors.Unavailable(f"the scheduler failed ({self.failure!r}) and restarts")
        self._watch.check_admission()

    async def _stored_segments(self, block_hashes: list[int]) -> int | None:
        """How many leading segments of the prompt the prefix tier holds
        (None: the cache did not answer)."""
        if self._cache is None or not (ids := self._core.prefix_segment_ids(block_hashes)):
            return 0
        with tracing.prefix_lookup_span(self._config.tracing, len(ids)) as span:
            tiers = await self._cache.stored_run(ids)
            span.set_attribute("kvstash.num_stored", len(tiers or ()))
        if self._metrics is not None:
            self._metrics.observe_lookup(tiers)
        return None if tiers is None else len(tiers)

    def submit(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
        stored_segments: int | None = 0, block_hashes: Sequence[int] = (),
    ) -> RequestStream:
        """Admits a request to decode here, as `admit` but at once, its prompt's
        first `stored_segments` held by the prefix tier (Scheduler.add_request)."""
        self._check_admission()
        self._core.add_request(request_id, prompt_token_ids, sampling,
                               stored_segments=stored_segments, block_hashes=block_hashes)
        stream = self._requests.open(request_id)
        self._wake.set()
        return stream

    def abort(self, request_id: str,
              reported_as: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Aborts a live request, or one being admitted (NotFound otherwise);
        its stream ends with an update of status `reported_as`
        (FINISHED_STOPPED where the edge found a stop string, which only it
        can see)."""
        if self._requests.abort_admission(request_id):
            return  # admit ends it
        usage = self._core.abort(request_id)
        if (stream := self._end(request_id)) is not None:
            stream.end(RequestUpdate(request_id, [], reported_as, usage,
                                     usage.num_cached_tokens))
        # Now, not at the step loop's next turn: it waits while the worker is away.
        self._copies.delete_snapshots(self._core.take_snapshots_to_delete())
        self._wake.set()

    def _end(self, request_id: str) -> RequestStream | None:
        """Drops the record of a request the core let go of; its stream, to
        end. A decode instance it was reserved on or handed to lets go too."""
        record = self._requests.close(request_id)
        if record is None:
            return None
        if record.handoff is not None:
            assert self._prefill is not None
            self._prefill.let_go(record.handoff)
        return record.stream

    @property
    def decode_side(self) -> DecodeSide:
        """A decode instance's reserve and decode (FailedPrecondition elsewhere)."""
        if self._decode is None:
            raise errors.FailedPrecondition(f"role {self.role.value} is no decode instance")
        return self._decode

    # -- the step loop ------------------------------------------------------

    async def _run(self) -> None:
        """The step loop; any exception out of it is a bug here (_fail_for_good)."""
        try:
            await self._serve()
        except Exception as exc:
            log.exception("the step loop failed; the scheduler must restart")
            await self._fail_for_good(exc)

    async def _serve(self) -> None:
        """Steps over one Execute stream at a time. Whatever breaks a stream
        (the worker restarted, is unreachable or hung, or answered nonsense)
        fails the requests whose state the worker held; a new stream is
        opened once the worker answers again, and the others go on there. The
        worker counts as up (`worker_up`, reported to `on_worker_change`)
        exactly while a stream is open."""
        while True:
            await self._watch.wait_ready(self._fail_waiting)
            stream: StepStream | None = None
            try:
                stream = await self._worker.open()
                # A stream that dies while the loop is idle wakes it, so the next
                # request never meets a dead stream or stale cached prefixes.
                stream.add_done_callback(self._wake.set)
                await self._watch.set_up(True)
                await self._steps(stream)
            except errors.Unavailable as exc:
                reason = str(exc)
            finally:
                if stream is not None:
                    stream.cancel()
            await self._watch.set_up(False)
            self._lose_worker(reason)
            await asyncio.sleep(self._worker.retry_s)

    def _lose_worker(self, reason: str) -> None:
        """The stream broke: fails the requests whose state the worker held
        (`Scheduler.requests_on_worker` says which, and why); the others
        wait for it (worker_watch)."""
        self._watch.lost(reason)
        lost = self._core.requests_on_worker()
        log.error("worker stream broke (%s); failing the %d requests it held, the other %d "
                  "wait up to %g s for it", reason, len(lost), len(self._requests) - len(lost),
                  self._config.worker_reconnect_s)
        self._fail(lost, errors.Unavailable(f"worker unavailable: {reason}"))
        # The next stream may reach a restarted worker with an empty KV
        # tensor: no cached prefix can be trusted any more.
        self.flush_prefix_cache(kv_lost=True)

    def _task_failed(self, exc: BaseException) -> None:
        """A task beside the step loop raised: a bug, as in the loop. The
        engine ends now (the loop may be waiting for a worker), and the loop
        raises it at its next turn."""
        if self._task_failure is None:
            self._task_failure = RuntimeError(f"a task beside the step loop failed: {exc!r}")
            self._task_failure.__cause__ = exc
            self._tasks.spawn(self._fail_for_good(self._task_failure), name="fail-for-good")
        self._wake.set()

    async def _fail_for_good(self, exc: Exception) -> None:
        """A bug broke the step loop. Stepping on would repeat it (a worker
        reconnect changes nothing here), so every request ends now
        (Unavailable: its client retries elsewhere), without asking the core,
        whose state is suspect; nothing new is admitted; wait_failed returns."""
        if self.failure is not None:
            return
        self.failure = exc
        await self._watch.set_up(False)
        error = errors.Unavailable(f"the scheduler failed ({exc!r}) and restarts")
        for request_id in self._requests:
            if (stream := self._end(request_id)) is not None:
                stream.fail(error, None)
        self._failed.set()

    def _fail_waiting(self, error: errors.Unavailable) -> None:
        """The worker was not back in time: fails every request left."""
        self._fail(self._requests, error)

    async def _steps(self, stream: StepStream) -> None:
        core = self._core
        tracing_on = self._config.tracing
        requests = self._requests
        while True:
            if self._task_failure is not None:
                raise self._task_failure
            if stream.done():
                raise errors.Unavailable("the worker ended the Execute stream")
            output = core.schedule()
            for choice in output.preempted:
                self._preempted(choice)
            for offload in output.offloads:
                self._tasks.spawn(self._copies.offload(offload))
            for restore in output.restores:
                self._tasks.spawn(self._copies.restore(restore))
            for load in output.prefix_loads:
                self._tasks.spawn(self._copies.load_prefix(load))
            for save in output.prefix_saves:
                self._tasks.spawn(self._copies.save_prefix(save))
            if output.handoffs:
                assert self._prefill is not None, "only a prefill instance hands off"
                for handoff in output.handoffs:
                    self._tasks.spawn(self._prefill.hand_off(handoff))
            self._copies.delete_snapshots(core.take_snapshots_to_delete())
            if not output.seqs:
                # What changed with no step to follow (a load's or restore's
                # evictions, a copy that landed) is told now, not at the next step.
                self._publish_kv_events()
                if self._config.check_integrity:
                    self._check_integrity()
                # Nothing to compute until a request arrives, a copy lands or
                # the stream dies. No await since schedule(): no wake-up missed.
                self._wake.clear()
                await self._wake.wait()
                continue
            if tracing_on:
                for seq in output.seqs:
                    if (s := requests.stream(seq.request_id)) is not None and (
                            s.phases is not None):
                        s.phases.scheduled()
            started = time.monotonic()
            sampled = await stream.step(output)
            core.observe_step(output, time.monotonic() - started)
            try:
                updates = core.update(output, sampled)
            except errors.InvalidArgument as exc:  # refused before any state changed
                raise errors.Unavailable(f"the worker's answer made no sense: {exc}") from exc
            for update in updates:
                if update.finish_status is not None:
                    request_stream = self._end(update.request_id)  # no handoff now
                else:
                    request_stream = requests.stream(update.request_id)
                if request_stream is not None:
                    request_stream.push(update)
            if self._kv_events is not None:
                self._publish_kv_events()
            # Let request streams, copies and new arrivals run between steps.
            await asyncio.sleep(0)

    def flush_prefix_cache(self, kv_lost: bool = False) -> int:
        """Forgets every cached prefix (the KV events say so); the blocks
        freed. `kv_lost`: the worker lost their KV (Scheduler.reset_prefix_cache)."""
        freed = self._core.reset_prefix_cache(kv_lost)
        self._publish_kv_events()
        return freed

    def _publish_kv_events(self) -> None:
        """The prefix cache's changes since the last call, to `kv_events`."""
        if self._kv_events is not None and (events := self._core.take_kv_events()):
            self._kv_events(events)

    def check_integrity(self) -> None:
        """IntegrityError: the core's invariants, or the records vs its requests."""
        self._core.check_integrity()
        self._requests.check(self._core)

    def _check_integrity(self) -> None:
        try:
            self.check_integrity()
        except IntegrityError:
            log.critical("scheduler state broken; exiting", exc_info=True)
            logging.shutdown()
            os._exit(INTEGRITY_EXIT_CODE)

    def _fail(self, request_ids: Iterable[str], error: errors.KvstashError) -> None:
        """Fails these requests but those decoding on a decode instance (P/D):
        they need this worker no more. Their snapshots leave the cache now,
        not once a worker is back."""
        for request_id in list(request_ids):
            record = self._requests.get(request_id)
            if record is not None and record.relayed:
                continue
            usage = None
            with contextlib.suppress(errors.NotFound):
                usage = self._core.abort(request_id)
            if (stream := self._end(request_id)) is not None:
                stream.fail(error, usage)
        self._copies.delete_snapshots(self._core.take_snapshots_to_delete())

    def _preempted(self, choice: Preempted) -> None:
        """A preemption, either mode, to the request's trace and the metrics."""
        tracing.preempted(self._requests.trace_context(choice.request_id), choice)
        if self._metrics is not None:
            self._metrics.observe_preemption(choice)
