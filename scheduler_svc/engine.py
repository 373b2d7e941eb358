"""The step loop: drives the scheduler core against one worker.

One asyncio task owns the core. Every core call is synchronous and short; all
I/O is awaited outside the core, so nothing is held across I/O and a slow
copy never stalls the steps of other requests.

    core.schedule() --> WorkerLink.step() --> core.update() --> request streams
        |
        +-- offloads / restores: their own tasks; each outcome goes back into
            the core (finish_offload / finish_restore) and wakes the loop

Every step's wall time and every successful copy's duration go back into the
core (`observe_step`, `finish_offload` / `finish_restore`): they are what its
cost model learns AUTO preemption's choice from. Each preemption, either mode,
is a "preempted" event on the request's trace and a count by mode and reason.

P/D disaggregation (decode_peers.py):
    prefill instance  `find_decoder` reserves blocks on a decode instance
                      before the request is submitted; once prefilled, the
                      core hands it off (`out.handoffs`): its KV is put in the
                      cache, then `_relay` streams the decode instance's
                      tokens into the request's stream. A failed put decodes
                      here; a decode instance lost before its first token
                      (expired reservation, gone) is replaced by another
                      reservation; one lost later, or no reservation in time,
                      gives the request back to the core (`take_back`):
                      never lost. A lost worker leaves them decoding there.
    decode instance   `reserve` and `decode` (a restore into the reserved
                      blocks, then decoding as usual); a timer wakes the loop
                      when a reservation may have expired.

Tracing (only with EngineConfig.tracing; see kvstash.telemetry): each request
keeps the trace context it was submitted in (its Generate span). Its copies
run inside that context as "kvstash.offload" / "kvstash.restore" spans, so
the worker's and the cache's spans join the request's trace, as do its
phases in the scheduler (tracing.RequestPhases: queued, prefill, decode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from kvstash import errors
from kvstash.sampling import SamplingParams
from kvstash.v1 import scheduler_pb2
from scheduler_svc import tracing
from scheduler_svc.cache_link import CacheLink
from scheduler_svc.core.block_pool import IntegrityError
from scheduler_svc.core.kv_events import KvEvent
from scheduler_svc.core.outputs import (
    OffloadCommand,
    Preempted,
    RequestUpdate,
    RestoreCommand,
)
from scheduler_svc.core.request import RequestStatus, RequestUsage
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.decode_peers import DecodePeer, DecodePeers
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.streams import RequestStream
from scheduler_svc.worker_link import CopyOutcome, StepStream, WorkerLink

log = logging.getLogger(__name__)

# How a scheduler run with EngineConfig.check_integrity exits on a broken invariant.
INTEGRITY_EXIT_CODE = 70
# Decode instances a handed-off request is offered to, one after another, while
# each is lost before sending a token (its reservation expired, it went away).
_HANDOFF_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # One offload or restore, end to end: the worker bounds its cache calls by it.
    transfer_timeout_s: float = 60.0
    # Emit phase and transfer spans (kvstash.telemetry is on). Off, the step
    # loop builds no span data at all.
    tracing: bool = False
    # Check every invariant of the core (O(pool + requests)) whenever the loop
    # goes idle, and exit the process on a broken one: for tests.
    check_integrity: bool = False


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
        `decode_peers`: this is a P/D prefill instance, handing off to them.
        `kv_events`: told the prefix cache's changes after every step."""
        self._core = core
        self._worker = worker
        self._cache = cache
        self._config = config
        self._metrics = metrics
        self._on_worker_change = on_worker_change
        self._worker_up = asyncio.Event()
        self._req_to_stream: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._peers = decode_peers
        self._kv_events = kv_events
        if kv_events is not None:
            core.record_kv_events()
        # P/D, prefill instance: where each request's decode was reserved, and
        # the task relaying it once handed off.
        self._decoders: dict[str, DecodePeer] = {}
        self._relays: dict[str, asyncio.Task[None]] = {}

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
        self._spawn(self._run(), name="step-loop")
        if self._cache is not None:
            self._spawn(self._cache.watch(self._core.set_cache_available))

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def submit(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
        decoder: DecodePeer | None = None,
    ) -> RequestStream:
        """Admits a request (raises InvalidArgument / AlreadyExists /
        ResourceExhausted) and returns the stream its tokens arrive on.
        `decoder` (from find_decoder): decode it there once prefilled."""
        try:
            self._core.add_request(request_id, prompt_token_ids, sampling,
                                   handoff=decoder is not None)
        except errors.KvstashError:
            if decoder is not None:
                self._spawn(self._release(decoder, request_id))
            raise
        if decoder is not None:
            self._decoders[request_id] = decoder
        return self._new_stream(request_id)

    def _new_stream(self, request_id: str) -> RequestStream:
        stream = RequestStream()
        if self._config.tracing:
            stream.trace_context = otel_context.get_current()
            stream.phases = tracing.RequestPhases(stream.trace_context)
        self._req_to_stream[request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str,
              reported_as: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Aborts a live request (NotFound otherwise); its stream ends with an
        update of status `reported_as` (FINISHED_STOPPED where the edge found
        a stop string, which only it can see). Blocks and snapshot are
        released by the core (and by the decode instance it was reserved on
        or handed to)."""
        usage = self._core.abort(request_id)
        if (stream := self._req_to_stream.pop(request_id, None)) is not None:
            stream.end(RequestUpdate(request_id, [], reported_as, usage,
                                     usage.num_cached_tokens))
        self._let_go_of_decoder(request_id)
        self._wake.set()

    # -- the step loop ------------------------------------------------------

    async def _run(self) -> None:
        """Steps over one Execute stream at a time. Whatever breaks a stream
        (the worker restarted or is unreachable, or answered nonsense) fails
        the requests in flight; then a new stream is opened once the worker
        answers again. The worker counts as up (`worker_up`, reported to
        `on_worker_change`) exactly while a stream is open."""
        while True:
            await self._worker.wait_ready()
            stream: StepStream | None = None
            try:
                stream = await self._worker.open()
                # A stream that dies while the loop is idle wakes it, so the next
                # request never meets a dead stream or stale cached prefixes.
                stream.add_done_callback(self._wake.set)
                await self._set_worker_up(True)
                await self._steps(stream)
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except errors.Unavailable as exc:
                reason = str(exc)
            except Exception as exc:
                log.exception("step loop failed")
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                if stream is not None:
                    stream.cancel()
            await self._set_worker_up(False)
            log.error("worker stream broke (%s); failing in-flight requests", reason)
            self._fail_all(errors.Unavailable(f"worker unavailable: {reason}"))
            self._delete_snapshots(self._core.take_snapshots_to_delete())  # not when it is back
            # The next stream may reach a restarted worker with an empty KV
            # tensor: no cached prefix can be trusted any more.
            self._core.reset_prefix_cache()
            self.publish_kv_events()
            await asyncio.sleep(self._worker.retry_s)

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

    async def _steps(self, stream: StepStream) -> None:
        core = self._core
        tracing_on = self._config.tracing
        streams = self._req_to_stream
        while True:
            if stream.done():
                raise errors.Unavailable("the worker ended the Execute stream")
            output = core.schedule()
            for choice in output.preempted:
                self._preempted(choice)
            for offload in output.offloads:
                self._spawn(self._offload(offload))
            for restore in output.restores:
                self._spawn(self._restore(restore))
            for handoff in output.handoffs:
                self._spawn(self._hand_off(handoff))
            self._delete_snapshots(core.take_snapshots_to_delete())
            if not output.seqs:
                if self._config.check_integrity:
                    self._check_integrity()
                # Nothing to compute until a request arrives, a copy lands or
                # the stream dies. No await since schedule(): no wake-up missed.
                self._wake.clear()
                await self._wake.wait()
                continue
            if tracing_on:
                for seq in output.seqs:
                    if (s := streams.get(seq.request_id)) is not None and s.phases is not None:
                        s.phases.scheduled()
            started = time.monotonic()
            sampled = await stream.step(output)
            core.observe_step(output, time.monotonic() - started)
            for update in core.update(output, sampled):
                if update.finish_status is not None:
                    request_stream = streams.pop(update.request_id, None)
                    if self._decoders:  # its first token ended it: no handoff
                        self._let_go_of_decoder(update.request_id)
                else:
                    request_stream = streams.get(update.request_id)
                if request_stream is not None:
                    request_stream.push(update)
            if self._kv_events is not None:
                self.publish_kv_events()
            # Let request streams, copies and new arrivals run between steps.
            await asyncio.sleep(0)

    def publish_kv_events(self) -> None:
        """The prefix cache's changes since the last call, to `kv_events`."""
        if self._kv_events is not None and (events := self._core.take_kv_events()):
            self._kv_events(events)

    def _check_integrity(self) -> None:
        try:
            self._core.check_integrity()
        except IntegrityError:
            log.critical("scheduler state broken; exiting", exc_info=True)
            logging.shutdown()
            os._exit(INTEGRITY_EXIT_CODE)

    def _fail_all(self, error: errors.KvstashError) -> None:
        """Fails every request but those decoding on a decode instance (P/D):
        they need this worker no more."""
        for request_id in list(self._req_to_stream):
            if request_id in self._relays:
                continue
            stream = self._req_to_stream.pop(request_id)
            usage = None
            with contextlib.suppress(errors.NotFound):
                usage = self._core.abort(request_id)
            stream.fail(error, usage)
            self._let_go_of_decoder(request_id)

    # -- copies -------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str | None = None) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _traced(self, request_id: str) -> otel_context.Context | None:
        """The request's trace context, when tracing is on and it is live."""
        stream = self._req_to_stream.get(request_id) if self._config.tracing else None
        return None if stream is None else stream.trace_context

    def _preempted(self, choice: Preempted) -> None:
        """A preemption, either mode, to the request's trace and the metrics."""
        tracing.preempted(self._traced(choice.request_id), choice)
        if self._metrics is not None:
            self._metrics.observe_preemption(choice)

    async def _offload(self, cmd: OffloadCommand) -> None:
        """Whatever happens, the core hears back: the blocks stay pinned until it does."""
        outcome = CopyOutcome(None, "cancelled", maybe_stored=True)
        started = time.monotonic()
        with tracing.transfer_span(self._traced(cmd.request_id), "kvstash.offload",
                                   cmd) as span:
            try:
                outcome = await self._worker.offload(cmd, self._config.transfer_timeout_s)
            finally:
                seconds = time.monotonic() - started
                self._report("offload", cmd, outcome, span, seconds)
                if outcome.maybe_stored:
                    self._delete_snapshots([cmd.snapshot_id])
                self._core.finish_offload(cmd, outcome.num_bytes, seconds)
                self._landed()

    async def _restore(self, cmd: RestoreCommand) -> None:
        outcome = CopyOutcome(None, "cancelled")
        started = time.monotonic()
        with tracing.transfer_span(self._traced(cmd.request_id), "kvstash.restore",
                                   cmd) as span:
            try:
                outcome = await self._worker.restore(cmd, self._config.transfer_timeout_s)
            finally:
                seconds = time.monotonic() - started
                self._report("restore", cmd, outcome, span, seconds)
                self._core.finish_restore(cmd, outcome.num_bytes, seconds)
                self._landed()

    def _report(
        self, kind: str, cmd: OffloadCommand | RestoreCommand, outcome: CopyOutcome,
        span: trace.Span, seconds: float,
    ) -> None:
        """A copy's outcome (`kind`: offload, restore or handoff) to the log,
        its span and the duration metric."""
        if outcome.num_bytes is None:
            log.warning("%s of %s failed (%s); %s instead", kind, cmd.request_id, outcome.error,
                        "decoding here" if kind == "handoff" else "recomputing")
            tracing.set_failed(span, outcome.error)
            return
        if self._metrics is not None and kind != "handoff":
            histogram = self._metrics.offload_s if kind == "offload" else self._metrics.restore_s
            histogram.observe(seconds)
        tracing.set_copied(span, outcome.num_bytes)

    def _landed(self) -> None:
        """After the core heard of a copy: send the deletes it queued, wake the loop."""
        self._delete_snapshots(self._core.take_snapshots_to_delete())
        self._wake.set()

    def _delete_snapshots(self, snapshot_ids: list[str]) -> None:
        if self._cache is not None and snapshot_ids:
            self._spawn(self._cache.delete(snapshot_ids))

    # -- P/D: prefill instance ---------------------------------------------

    async def find_decoder(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> DecodePeer | None:
        """A decode instance that reserved blocks for the request (checked
        first as submit would: InvalidArgument, AlreadyExists), or None:
        decode here (not a prefill instance, one token only, or none reserved
        in time)."""
        if self._peers is None or sampling.max_tokens < 2:
            return None
        self._core.check_request(request_id, prompt_token_ids, sampling)
        return await self._peers.reserve(request_id, prompt_token_ids, sampling)

    async def _hand_off(self, cmd: OffloadCommand) -> None:
        """Puts a prefilled request's KV in the cache for its decode instance,
        then relays that instance's tokens. The core hears of the copy
        whatever happens, as for an offload."""
        outcome = CopyOutcome(None, "cancelled", maybe_stored=True)
        started = time.monotonic()
        with tracing.transfer_span(self._traced(cmd.request_id), "kvstash.handoff",
                                   cmd) as span:
            try:
                outcome = await self._worker.offload(cmd, self._config.transfer_timeout_s)
            finally:
                self._report("handoff", cmd, outcome, span, time.monotonic() - started)
                if outcome.maybe_stored:
                    self._delete_snapshots([cmd.snapshot_id])
                handed_off = self._core.pd.finish_handoff(
                    cmd, outcome.num_bytes, time.monotonic() - started)
                self._landed()
        decoder = self._decoders.get(cmd.request_id)
        if not handed_off or decoder is None:
            self._let_go_of_decoder(cmd.request_id)  # decoding here, or aborted
            return
        request_id = cmd.request_id
        req = self._core.get_request(request_id)
        assert req is not None and self._peers is not None
        first_token_id = req.output_token_ids[-1]
        self._relays[request_id] = asyncio.current_task()  # type: ignore[assignment]
        # The Decode call joins the request's trace.
        trace_context = self._traced(request_id)
        token = None if trace_context is None else otel_context.attach(trace_context)
        try:
            for attempt in range(1, _HANDOFF_ATTEMPTS + 1):
                reason = await self._relay(decoder, cmd, first_token_id, started)
                if reason is None:
                    return  # finished there, or taken back after its tokens began
                log.warning("request %s: decode instance %s lost before its first token (%s)%s",
                            request_id, decoder.address, reason,
                            "; trying again" if attempt < _HANDOFF_ATTEMPTS else "")
                # Its reservation expired, or the instance went away: the
                # snapshot is still in the cache for another reservation.
                if attempt == _HANDOFF_ATTEMPTS or (decoder := await self._peers.reserve(
                        request_id, req.prompt_token_ids, req.sampling)) is None:
                    break
                self._decoders[request_id] = decoder
            log.warning("request %s: finishing it here", request_id)
            self._core.pd.take_back(request_id)
            self._wake.set()
        finally:
            if token is not None:
                otel_context.detach(token)
            self._relays.pop(request_id, None)
            self._decoders.pop(request_id, None)

    async def _relay(
        self, decoder: DecodePeer, cmd: OffloadCommand, first_token_id: int, started: float
    ) -> str | None:
        """The decode instance's tokens into the request's stream. None once
        the request finished there, or was lost there after some tokens (the
        core took it back: it is recomputed here); else why it was lost
        before sending any."""
        assert self._peers is not None
        request_id = cmd.request_id
        core = self._core
        first = True
        try:
            async for response in self._peers.decode(
                    decoder, request_id, cmd.snapshot_id, cmd.num_tokens, first_token_id):
                if first and self._metrics is not None:
                    self._metrics.handoff_s.observe(time.monotonic() - started)
                first = False
                finish = response.finish_reason
                if finish == scheduler_pb2.FINISH_REASON_ABORT:
                    reason = "aborted there"
                    break
                if finish:
                    update = core.pd.finish_remote(
                        request_id, response.token_ids, finish == scheduler_pb2.FINISH_REASON_STOP,
                        _remote_usage(response.usage))
                    stream = self._req_to_stream.pop(request_id, None)
                else:
                    update = core.pd.remote_tokens(request_id, response.token_ids)
                    stream = self._req_to_stream.get(request_id)
                if update is not None and stream is not None:
                    stream.push(update)
                if finish:
                    return None
            else:
                reason = "its stream ended early"
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except errors.InvalidArgument as exc:  # tokens it could not have generated
            reason = str(exc)
        if first:
            return reason
        log.warning("request %s: decode instance %s lost (%s); finishing it here",
                    request_id, decoder.address, reason)
        core.pd.take_back(request_id)
        self._wake.set()
        return None

    def _let_go_of_decoder(self, request_id: str) -> None:
        """The request will not (or no longer) decode on its decode instance:
        stop relaying (which aborts it there) or release the reservation."""
        decoder = self._decoders.pop(request_id, None)
        if (relay := self._relays.pop(request_id, None)) is not None:
            relay.cancel()
        elif decoder is not None:
            self._spawn(self._release(decoder, request_id))

    async def _release(self, decoder: DecodePeer, request_id: str) -> None:
        assert self._peers is not None
        await self._peers.release(decoder, request_id)

    # -- P/D: decode instance ----------------------------------------------

    def reserve(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> bool:
        """Holds blocks for a prefill instance's request (Scheduler.reserve);
        False: refused, ask again later."""
        if not self._core.pd.reserve(request_id, prompt_token_ids, sampling):
            return False
        # The step loop expires it if unused: wake it then.
        asyncio.get_running_loop().call_later(
            self._core.config.reservation_timeout_s, self._wake.set)
        return True

    def decode(
        self, request_id: str, snapshot_id: str, num_tokens: int, first_token_id: int
    ) -> RequestStream:
        """Restores a reserved request's prompt KV and decodes it: its stream
        (raises NotFound / InvalidArgument as Scheduler.start_remote_decode)."""
        cmd = self._core.pd.start_remote_decode(request_id, snapshot_id, num_tokens,
                                                first_token_id)
        stream = self._new_stream(request_id)
        self._spawn(self._restore(cmd))
        return stream


def _remote_usage(usage: scheduler_pb2.Usage) -> RequestUsage:
    """What a decode instance reports of its part of a request."""
    return RequestUsage(usage.prompt_tokens, usage.completion_tokens, usage.num_preemptions,
                        usage.num_recomputed_tokens, usage.bytes_offloaded, None)
