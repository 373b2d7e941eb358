"""KV copies between the worker's blocks and the cache, for the engine (offload,
restore) and the hand-off (the prefill side's put of a prefilled request).

Each copy runs as its own task; whatever happens (success, failure, the task
cancelled), the core hears back: the blocks stay pinned until it does. Then
the snapshot deletes the core queued are sent and the step loop is woken.

    put(cmd, kind, finish)  worker.offload -> delete a snapshot that may exist
                            but will never be read -> finish(...) -> report
    restore(cmd, fallback)  worker.restore -> report -> core.finish_restore
    save_prefix(cmd)        worker.offload (shared_prefix) -> core.finish_prefix_save
    load_prefix(load)       worker.restore (keep) of every segment at once; the
                            request takes those up to the first that failed
                            (deleted if damaged) -> core.finish_prefix_load

Offloads and restores are bounded by transfer_timeout_s, the prefix tier's
copies by prefix_copy_timeout_s (short: EngineConfig says why).

A copy's report: a failure is logged and marks its span failed; a success
marks its span with the bytes copied and times the offload or restore
histogram (a hand-off has its own: time to the decode instance's first token).
Each copy runs in the request's trace context as a "kvstash.<kind>" span.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from opentelemetry import trace

from scheduler_svc import tracing
from scheduler_svc.cache_link import CacheLink
from scheduler_svc.core.outputs import OffloadCommand, PrefixLoad, RestoreCommand
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.inflight import InFlightRequests, Tasks
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.worker_link import CopyOutcome, WorkerLink

log = logging.getLogger(__name__)

T = TypeVar("T")
# What the core is told of a put: (command, bytes or None, seconds) -> its answer.
Finish = Callable[[OffloadCommand, int | None, float], T]


class Copies:
    def __init__(
        self, core: Scheduler, worker: WorkerLink, cache: CacheLink | None,
        requests: InFlightRequests, tasks: Tasks, wake: Callable[[], None], *,
        transfer_timeout_s: float, prefix_copy_timeout_s: float,
        metrics: SchedulerMetrics | None,
    ) -> None:
        """`wake`: wakes the step loop (a copy landed); `transfer_timeout_s`
        and `prefix_copy_timeout_s` as EngineConfig says."""
        self._core = core
        self._worker = worker
        self._cache = cache
        self._requests = requests
        self._tasks = tasks
        # Snapshot deletes, apart: the engine's close lets them finish.
        self.deletes = Tasks(tasks.on_failure)
        self._wake = wake
        self._timeout_s = transfer_timeout_s
        self._prefix_timeout_s = prefix_copy_timeout_s
        self._metrics = metrics

    async def offload(self, cmd: OffloadCommand) -> None:
        await self.put(cmd, "offload", self._core.finish_offload)

    async def put(self, cmd: OffloadCommand, kind: str, finish: Finish[T]) -> T:
        """Copies cmd's blocks into the cache (`kind`: offload or handoff)
        and returns what `finish` (the core's answer to it) returns."""
        outcome = CopyOutcome(None, "cancelled", maybe_stored=True)
        started = time.monotonic()
        with tracing.transfer_span(self._requests.trace_context(cmd.request_id),
                                   f"kvstash.{kind}", cmd) as span:
            try:
                outcome = await self._worker.offload(cmd, self._timeout_s)
            finally:
                seconds = time.monotonic() - started
                if outcome.maybe_stored:
                    self.delete_snapshots([cmd.snapshot_id])
                answer = finish(cmd, outcome.num_bytes, seconds)
                self._report(kind, cmd, outcome, span, seconds, self._put_fallback(kind, cmd))
                self._landed()
        return answer

    def _put_fallback(self, kind: str, cmd: OffloadCommand) -> str:
        """What a failed put led to, once the core heard of it: a hand-off
        decodes here from the blocks it kept, unless its seat was taken
        meanwhile (Lifecycle.finish_handoff)."""
        req = self._core.get_request(cmd.request_id)
        if kind == "handoff" and req is not None and req.status is RequestStatus.RUNNING_DECODE:
            return "decode_here"
        return "recompute"

    async def restore(self, cmd: RestoreCommand, fallback: str = "recompute") -> CopyOutcome:
        """`fallback`: what a failed restore leads to (the core decides), for
        the log and the span: recompute, or given_back (a decode instance's
        hand-in). Returns how the copy ended."""
        outcome = CopyOutcome(None, "cancelled")
        started = time.monotonic()
        with tracing.transfer_span(self._requests.trace_context(cmd.request_id),
                                   "kvstash.restore", cmd) as span:
            try:
                outcome = await self._worker.restore(cmd, self._timeout_s)
            finally:
                seconds = time.monotonic() - started
                self._report("restore", cmd, outcome, span, seconds, fallback)
                self._core.finish_restore(cmd, outcome.num_bytes, seconds)
                self._landed()
        return outcome

    async def save_prefix(self, cmd: OffloadCommand) -> None:
        """A prefix-tier segment: nothing to delete whatever happens (it is
        named by its content, and the cache evicts what nobody reads)."""
        outcome = CopyOutcome(None, "cancelled")
        with tracing.transfer_span(self._requests.trace_context(cmd.request_id),
                                   "kvstash.prefix_save", cmd) as span:
            try:
                outcome = await self._worker.offload(cmd, self._prefix_timeout_s)
            finally:
                if outcome.num_bytes is None:
                    log.info("prefix segment save for %s failed (%s)", cmd.request_id,
                             outcome.error)
                    tracing.set_failed(span, outcome.error, "not_stored")
                else:
                    tracing.set_copied(span, outcome.num_bytes)
                self._core.finish_prefix_save(cmd, outcome.num_bytes)
                self._landed()

    async def load_prefix(self, load: PrefixLoad) -> None:
        """The segments are read at once (each into its own blocks); the
        request takes those up to the first that failed."""
        segments = load.segments
        outcomes = [CopyOutcome(None, "cancelled")] * len(segments)
        # Past the prefill it saves (the cost model's prediction), waiting
        # for a load costs more than prefilling would.
        timeout_s = max(self._prefix_timeout_s, load.predicted_prefill_s or 0.0)
        started = time.monotonic()
        with tracing.prefix_load_span(self._requests.trace_context(load.request_id),
                                      load) as span:
            try:
                outcomes = await asyncio.gather(*(
                    self._worker.restore(segment, timeout_s) for segment in segments))
            finally:
                num_loaded = next((i for i, o in enumerate(outcomes) if o.num_bytes is None),
                                  len(segments))
                num_bytes = sum(o.num_bytes or 0 for o in outcomes[:num_loaded])
                if num_loaded < len(segments):
                    error = outcomes[num_loaded].error
                    log.info("prefix segment load for %s failed (%s); prefilling from there",
                             load.request_id, error)
                    tracing.set_failed(span, error, "prefill")
                else:
                    tracing.set_copied(span, num_bytes)
                    if self._metrics is not None:
                        self._metrics.prefix_load_s.observe(time.monotonic() - started)
                # Stored anew by the prefill, where the cache's copy is damaged.
                self.delete_snapshots([s.snapshot_id for s, o in zip(segments, outcomes,
                                                                     strict=True) if o.damaged])
                self._core.finish_prefix_load(load, num_loaded, num_bytes,
                                              time.monotonic() - started)
                self._landed()

    def _report(
        self, kind: str, cmd: OffloadCommand | RestoreCommand, outcome: CopyOutcome,
        span: trace.Span, seconds: float, fallback: str = "recompute",
    ) -> None:
        """A copy's outcome to the log, its span and the duration metric;
        `fallback`, what a failure leads to."""
        if outcome.num_bytes is None:
            log.warning("%s of %s failed (%s); %s instead", kind, cmd.request_id, outcome.error,
                        fallback.replace("_", " "))
            tracing.set_failed(span, outcome.error, fallback)
            return
        if self._metrics is not None and kind != "handoff":
            histogram = self._metrics.offload_s if kind == "offload" else self._metrics.restore_s
            histogram.observe(seconds)
        tracing.set_copied(span, outcome.num_bytes)

    def _landed(self) -> None:
        """After the core heard of a copy: send the deletes it queued, wake the loop."""
        self.delete_snapshots(self._core.take_snapshots_to_delete())
        self._wake()

    def delete_snapshots(self, snapshot_ids: list[str]) -> None:
        if self._cache is not None and snapshot_ids:
            self.deletes.spawn(self._cache.delete(snapshot_ids))
