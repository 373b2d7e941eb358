"""The step loop: drives the scheduler core against one worker over gRPC.

One asyncio task owns the core. Every core call is synchronous and short; all
I/O (the worker's Execute stream, offloads, restores, cache look-ups) is
awaited outside the core, so nothing is ever held across I/O and a slow
offload never stalls the steps of other requests.

    schedule() --StepPlan--> worker --StepResult--> update() --> request streams
        |
        +-- offloads / restores: their own tasks; completions go back into the
            core (finish_offload / finish_restore) and wake the loop

Tracing (only with EngineConfig.tracing; see kvstash.telemetry): each request
keeps the trace context it was submitted in (its Generate span). Its offloads
and restores run inside that context as "kvstash.offload" / "kvstash.restore"
spans, so the worker's and the cache's spans join the request's trace, as do
its phases in the scheduler (tracing.RequestPhases: queued, prefill, decode).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import context as otel_context

from kvstash import errors
from kvstash.cache_client import CacheClient
from kvstash.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from scheduler_svc import tracing
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.outputs import OffloadCommand, RestoreCommand, SchedulerOutput
from scheduler_svc.request import Request, RequestStatus, SamplingParams
from scheduler_svc.scheduler import Scheduler

log = logging.getLogger(__name__)


# Offload failures after which the snapshot certainly does not exist.
_REFUSED = frozenset({
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DATA_LOSS,
})


@dataclass(slots=True)
class RequestEvent:
    """What a request's stream receives after a step."""

    new_token_ids: list[int]  # tokens produced since the previous event
    finish_status: RequestStatus | None  # FINISHED_* on the last event, else None


@dataclass(slots=True)
class RequestStream:
    request: Request  # owned by the core; read-only here (usage counters)
    events: asyncio.Queue[RequestEvent | errors.KvstashError] = field(
        default_factory=asyncio.Queue
    )
    finished: bool = False
    # The context the request was submitted in (its Generate span); None
    # unless tracing is on.
    trace_context: otel_context.Context | None = None
    phases: tracing.RequestPhases | None = None  # with trace_context


@dataclass(frozen=True, slots=True)
class EngineConfig:
    transfer_timeout_s: float = 60.0  # one offload or restore, end to end
    cache_poll_s: float = 0.5  # how often the cache's free capacity is refreshed
    worker_retry_s: float = 1.0  # pause before reopening a broken Execute stream
    worker_probe_s: float = 10.0  # bound on one GetInfo that checks the worker is back
    # Expiry of a stashed snapshot since its last access: a request preempted
    # for longer than this loses its snapshot and is recomputed.
    snapshot_ttl_s: int = 24 * 3600
    # Emit phase and transfer spans (kvstash.telemetry is on). Off, the step
    # loop builds no span data at all.
    tracing: bool = False


@functools.lru_cache(maxsize=4096)
def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Built once per distinct sampling setting, not once per sequence per step
    (SeqWork copies it, so the cached message is never mutated)."""
    proto = common_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        proto.seed = params.seed
    return proto


def plan_to_proto(output: SchedulerOutput) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(step_id=output.step_id, seqs=[
        worker_pb2.SeqWork(
            request_id=seq.request_id, token_ids=seq.token_ids, start_pos=seq.start_pos,
            block_ids=seq.block_ids, sample=seq.sample, sampling=sampling_to_proto(seq.sampling),
        )
        for seq in output.seqs
    ])


def _changed_fields(
    before: worker_pb2.WorkerInfo | None, after: worker_pb2.WorkerInfo
) -> list[str]:
    """WorkerInfo fields that differ; the device may change, nothing else."""
    if before is None:
        return []
    return [f.name for f in worker_pb2.WorkerInfo.DESCRIPTOR.fields
            if f.name != "device" and getattr(before, f.name) != getattr(after, f.name)]


class Engine:
    def __init__(
        self,
        core: Scheduler,
        worker_channel: grpc.aio.Channel,
        cache: CacheClient | None,
        config: EngineConfig = EngineConfig(),
        *,
        metrics: SchedulerMetrics | None = None,
        on_worker_change: Callable[[bool], Awaitable[None]] | None = None,
        worker_info: worker_pb2.WorkerInfo | None = None,
    ) -> None:
        """`on_worker_change(True)` is awaited once the worker answers and an
        Execute stream is open, `(False)` once that stream broke. With
        `worker_info` (what the core was built for), a worker that comes back
        with another model or KV layout is not used."""
        self._core = core
        self._worker = worker_pb2_grpc.WorkerStub(worker_channel)
        self._cache = cache
        self._config = config
        self._metrics = metrics
        self._on_worker_change = on_worker_change
        self._worker_info = worker_info
        self._worker_up = asyncio.Event()
        self._req_to_stream: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def core(self) -> Scheduler:
        return self._core

    @property
    def worker_up(self) -> bool:
        """An Execute stream to a live worker is open: requests can run."""
        return self._worker_up.is_set()

    async def wait_until_worker_up(self) -> None:
        await self._worker_up.wait()

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="step-loop")
        if self._cache is not None:
            self._spawn(self._poll_cache())
        else:
            self._core.set_offload_capacity(None)

    async def close(self) -> None:
        tasks = [t for t in [self._loop_task, *self._tasks] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def submit(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> RequestStream:
        """Admits a request (raises InvalidArgument / AlreadyExists) and returns
        the stream its tokens arrive on."""
        request = self._core.add_request(request_id, prompt_token_ids, sampling)
        stream = RequestStream(request)
        if self._config.tracing:
            stream.trace_context = otel_context.get_current()
            stream.phases = tracing.RequestPhases(stream.trace_context)
        self._req_to_stream[request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Aborts a live request (NotFound otherwise); its stream gets a final
        ABORTED event. Blocks and snapshot are released by the core."""
        self._core.abort(request_id)
        self._finish_stream(request_id, RequestEvent([], RequestStatus.FINISHED_ABORTED))
        self._wake.set()

    # -- the step loop ------------------------------------------------------

    async def _run(self) -> None:
        """Steps over one Execute stream at a time. Whatever breaks a stream
        (the worker restarted or is unreachable, or answered nonsense) fails
        the requests in flight; then a new stream is opened once the worker
        answers again. The worker counts as up (`worker_up`, reported to
        `on_worker_change`) exactly while a stream is open. The loop itself
        never ends but by cancellation."""
        while True:
            await self._wait_for_worker()
            call = self._worker.Execute()
            # A stream that dies while the loop is idle wakes it, so the next
            # request never meets a dead stream or stale cached prefixes.
            call.add_done_callback(lambda _: self._wake.set())
            try:
                await self._handshake(call)
                await self._set_worker_up(True)
                await self._steps(call)
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except errors.Unavailable as exc:
                reason = str(exc)
            except Exception as exc:
                log.exception("step loop failed")
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                call.cancel()
            await self._set_worker_up(False)
            log.error("worker stream broke (%s); failing in-flight requests", reason)
            self._fail_all(errors.Unavailable(f"worker unavailable: {reason}"))
            # The next stream may reach a restarted worker with an empty KV
            # tensor: no cached prefix can be trusted any more.
            self._core.reset_prefix_cache()
            await asyncio.sleep(self._config.worker_retry_s)

    async def _wait_for_worker(self) -> None:
        """Returns once the worker answers GetInfo: reachable, its model
        loaded, and the model and KV layout the core was built for."""
        reported: list[str] = []
        while True:
            try:
                info = await self._worker.GetInfo(
                    worker_pb2.GetInfoRequest(), wait_for_ready=True,
                    timeout=self._config.worker_probe_s)
                changed = _changed_fields(self._worker_info, info)
                if not changed:
                    return
                if changed != reported:
                    log.error("the worker came back with another %s; not using it "
                              "(restart the scheduler to adopt it)", ", ".join(changed))
                    reported = changed
            except grpc.aio.AioRpcError as exc:
                log.debug("worker not ready (%s: %s)", exc.code().name, exc.details())
            await asyncio.sleep(self._config.worker_retry_s)

    @staticmethod
    async def _handshake(call: grpc.aio.StreamStreamCall) -> None:
        """An empty step, answered only once the worker accepted this stream
        (it refuses a second scheduler): opening a call proves nothing."""
        await call.write(worker_pb2.StepPlan())
        if await call.read() is grpc.aio.EOF:
            raise errors.Unavailable("worker closed the Execute stream")

    async def _set_worker_up(self, up: bool) -> None:
        if up == self._worker_up.is_set():
            return
        if up:
            self._worker_up.set()
            log.info("worker stream open; serving")
        else:
            self._worker_up.clear()
        if self._on_worker_change is not None:
            await self._on_worker_change(up)

    async def _steps(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            if call.done():
                raise errors.Unavailable("the worker ended the Execute stream")
            output = self._core.schedule()
            for offload in output.offloads:
                self._spawn(self._offload(offload))
            for restore in output.restores:
                self._spawn(self._restore(restore))
            self._delete_snapshots(self._core.take_snapshots_to_delete())
            if not output.seqs:
                # Nothing to compute until a request arrives or a transfer
                # completes. No await since schedule(), so no wake-up was missed.
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._config.tracing:
                for seq in output.seqs:
                    stream = self._req_to_stream.get(seq.request_id)
                    if stream is not None and stream.phases is not None:
                        stream.phases.scheduled()
            await call.write(plan_to_proto(output))
            result = await call.read()
            if result is grpc.aio.EOF:
                raise errors.Unavailable("worker closed the Execute stream")
            sampled = {t.request_id: t.token_id for t in result.sampled}
            for update in self._core.update(output, sampled):
                stream = self._req_to_stream.get(update.request_id)
                if stream is None:
                    continue
                event = RequestEvent(update.new_token_ids, update.finish_status)
                if stream.phases is not None and update.new_token_ids:
                    stream.phases.produced()
                if update.finish_status is not None:
                    self._finish_stream(update.request_id, event)
                else:
                    stream.events.put_nowait(event)
            # Let request streams, transfers and new arrivals run between steps.
            await asyncio.sleep(0)

    def _traced(self, request_id: str) -> otel_context.Context | None:
        """The request's trace context, when tracing is on and it is live."""
        stream = self._req_to_stream.get(request_id) if self._config.tracing else None
        return None if stream is None else stream.trace_context

    def _finish_stream(self, request_id: str, event: RequestEvent) -> None:
        stream = self._req_to_stream.pop(request_id, None)
        if stream is not None:
            stream.finished = True
            stream.events.put_nowait(event)
            if stream.phases is not None and event.finish_status is not None:
                stream.phases.end(event.finish_status.name)

    def _fail_all(self, error: errors.KvstashError) -> None:
        for request_id in list(self._req_to_stream):
            with contextlib.suppress(errors.NotFound):
                self._core.abort(request_id)
            stream = self._req_to_stream.pop(request_id)
            stream.finished = True
            stream.events.put_nowait(error)
            if stream.phases is not None:
                stream.phases.end("error")

    # -- transfers ----------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _offload(self, cmd: OffloadCommand) -> None:
        """Whatever happens, the core hears back: the blocks stay pinned until it does."""
        num_bytes: int | None = None
        trace_context = self._traced(cmd.request_id)
        tracing.request_event(trace_context, "preempted", {"mode": "offload"})
        started = time.monotonic()
        with tracing.transfer_span(trace_context, "kvstash.offload", cmd) as span:
            try:
                response = await self._worker.Offload(
                    worker_pb2.OffloadRequest(
                        request_id=cmd.request_id, snapshot_id=cmd.snapshot_id,
                        block_ids=cmd.block_ids, num_tokens=cmd.num_tokens, pinned=True,
                        ttl_s=self._config.snapshot_ttl_s,
                    ),
                    timeout=self._config.transfer_timeout_s,
                )
                num_bytes = response.num_bytes
                if self._metrics is not None:
                    self._metrics.observe_offload(time.monotonic() - started)
                span.set_attributes({"kvstash.bytes": num_bytes, "kvstash.outcome": "stored"})
            except grpc.aio.AioRpcError as exc:
                log.warning("offload of %s failed (%s: %s); recomputing instead",
                            cmd.request_id, exc.code().name, exc.details())
                tracing.set_failed(span, f"{exc.code().name}: {exc.details()}")
                if exc.code() not in _REFUSED:  # the put may have landed after all
                    self._delete_snapshots([cmd.snapshot_id])
            except Exception as exc:
                log.exception("offload of %s failed; recomputing instead", cmd.request_id)
                tracing.set_failed(span, f"{type(exc).__name__}: {exc}")
                self._delete_snapshots([cmd.snapshot_id])
            finally:
                self._core.finish_offload(cmd.request_id, num_bytes)
                self._wake.set()

    async def _restore(self, cmd: RestoreCommand) -> None:
        ok = False
        started = time.monotonic()
        with tracing.transfer_span(self._traced(cmd.request_id), "kvstash.restore",
                                   cmd) as span:
            try:
                response = await self._worker.Restore(
                    worker_pb2.RestoreRequest(
                        request_id=cmd.request_id, snapshot_id=cmd.snapshot_id,
                        block_ids=cmd.block_ids,
                    ),
                    timeout=self._config.transfer_timeout_s,
                )
                ok = True
                if self._metrics is not None:
                    self._metrics.observe_restore(time.monotonic() - started)
                span.set_attributes({"kvstash.bytes": response.num_bytes,
                                     "kvstash.outcome": "restored"})
            except grpc.aio.AioRpcError as exc:
                log.warning("restore of %s failed (%s: %s); recomputing instead",
                            cmd.request_id, exc.code().name, exc.details())
                tracing.set_failed(span, f"{exc.code().name}: {exc.details()}")
            except Exception as exc:
                log.exception("restore of %s failed; recomputing instead", cmd.request_id)
                tracing.set_failed(span, f"{type(exc).__name__}: {exc}")
            finally:
                self._core.finish_restore(cmd.request_id, ok)  # queues the snapshot's deletion
                self._wake.set()

    def _delete_snapshots(self, snapshot_ids: list[str]) -> None:
        if self._cache is None or not snapshot_ids:
            return
        cache = self._cache

        async def delete() -> None:
            for snapshot_id in snapshot_ids:
                # Gone already is fine; unreachable is fine too: the cache's TTL
                # removes orphans.
                with contextlib.suppress(errors.KvstashError):
                    await cache.delete(snapshot_id)

        self._spawn(delete())

    async def _poll_cache(self) -> None:
        """Refreshes the cache's free capacity; None while it is unreachable
        (degraded: preemptions recompute). Logs each change, not each poll."""
        assert self._cache is not None
        available: bool | None = None  # unknown before the first poll
        while True:
            try:
                free_bytes: int | None = (await self._cache.stats()).free_bytes
            except errors.KvstashError as exc:
                free_bytes = None
                if available is not False:
                    log.warning("cache service %s unreachable (%s); preemptions recompute "
                                "until it is back", self._cache.address, exc)
            self._core.set_offload_capacity(free_bytes)
            if free_bytes is not None and not available:
                log.info("cache service %s available", self._cache.address)
            available = free_bytes is not None
            await asyncio.sleep(self._config.cache_poll_s)

