"""The scheduler's link to its worker: the Execute stream and the KV copies.

Converts the core's commands to worker protos and the worker's answers (and
gRPC status codes) back to plain outcomes, so the engine never handles a
proto or a status code.

    wait_ready()   GetInfo until the worker answers with the model and KV
                   layout the core was built for (or a deadline passes)
    open()         an Execute stream, proven by an empty handshake step
    StepStream.step(output) -> sampled token per request
                   (a broken stream, or one that fails to open, raises
                   errors.Unavailable "CODE: details": never a grpc error)
    offload(cmd) / restore(cmd) -> CopyOutcome (raises only when cancelled)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from kvstash import errors
from kvstash.common import wire
from kvstash.common.ids import MAX_REQUEST_ID_CHARS
from kvstash.common.rpc_connections import MAX_STEP_PLAN_BYTES, MAX_WORKER_INFO_BYTES
from kvstash.common.sampling import MAX_STOP_TOKEN_IDS
from kvstash.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.outputs import OffloadCommand, RestoreCommand, SchedulerOutput

log = logging.getLogger(__name__)

# The scheduler's channel to its worker: reconnect fast after a restart, take
# a GetInfo as large as the worker may send (the tokenizer rides in it), and
# send a step plan as large as it may take.
WORKER_CHANNEL_OPTIONS = [("grpc.max_reconnect_backoff_ms", 2000),
                          ("grpc.max_receive_message_length", MAX_WORKER_INFO_BYTES),
                          ("grpc.max_send_message_length", MAX_STEP_PLAN_BYTES)]
# One step's default bound, plan out to tokens back: far past any step a
# worker takes (seconds for a long prefill on a CPU), well short of forever.
STEP_TIMEOUT_S = 600.0
# Offload failures after which the snapshot certainly does not exist: the
# cache (or the worker) refused the put, and a refused put stores nothing
# (worker.proto Offload). The worker passes the cache's status on unchanged,
# so this is the one place a failure's meaning is read.
_NOT_STORED = frozenset({
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DATA_LOSS,
})


@dataclass(frozen=True, slots=True)
class CopyOutcome:
    """How one offload or restore ended."""

    # Bytes copied; None when the copy failed.
    num_bytes: int | None
    # Why it failed ("CODE: details"); empty on success.
    error: str = ""
    # A failed offload whose snapshot may have been stored after all (no
    # answer in time, or the call broke after the put started): the owner of
    # the snapshot, the engine, deletes it.
    maybe_stored: bool = False
    # A failed restore whose snapshot failed its checksums (DATA_LOSS): it is
    # damaged where it is stored.
    damaged: bool = False
    # A failed restore whose snapshot the cache does not hold (NOT_FOUND).
    missing: bool = False


def plan_to_proto(output: SchedulerOutput) -> worker_pb2.StepPlan:
    to_proto = wire.sampling_to_proto
    return worker_pb2.StepPlan(step_id=output.step_id, seqs=[
        worker_pb2.SeqWork(
            request_id=seq.request_id, token_ids=seq.token_ids, start_pos=seq.start_pos,
            block_ids=seq.block_ids, sample=seq.sample, sampling=to_proto(seq.sampling),
        )
        for seq in output.seqs
    ])


def largest_plan_bytes(config: SchedulerConfig) -> int:
    """At most how large one of this scheduler's step plans encodes: every
    seat taken by a sequence with the longest id, sampling settings and
    block table there are, and the step's tokens besides."""
    sampling = common_pb2.SamplingParams(
        max_tokens=config.max_model_len, temperature=0.5, top_p=0.5, top_k=2**32 - 1,
        seed=2**64 - 1, stop_token_ids=[config.vocab_size - 1] * MAX_STOP_TOKEN_IDS,
        ignore_eos=True)
    seq = worker_pb2.SeqWork(
        request_id="r" * MAX_REQUEST_ID_CHARS, start_pos=config.max_model_len,
        block_ids=[config.num_blocks - 1] * -(-config.max_servable_len // config.block_size),
        sample=True, sampling=sampling)
    tokens = worker_pb2.SeqWork(token_ids=[config.vocab_size - 1] * config.max_num_batched_tokens)
    # + a field tag and a length per sequence, and the step id
    return config.max_num_seqs * (seq.ByteSize() + 6) + tokens.ByteSize() + 16


def changed_fields(before: worker_pb2.WorkerInfo, after: worker_pb2.WorkerInfo) -> list[str]:
    """WorkerInfo fields that differ; the device may change, nothing else."""
    return [f.name for f in worker_pb2.WorkerInfo.DESCRIPTOR.fields
            if f.name != "device" and getattr(before, f.name) != getattr(after, f.name)]


class StepStream:
    """One open Execute stream: a plan out, its sampled tokens back."""

    def __init__(self, call: grpc.aio.StreamStreamCall, step_timeout_s: float) -> None:
        self._call = call
        self._step_timeout_s = step_timeout_s

    def done(self) -> bool:
        return self._call.done()

    def cancel(self) -> None:
        self._call.cancel()

    def add_done_callback(self, callback: Callable[[], object]) -> None:
        """Calls `callback()` once the stream ends, however it ends."""
        self._call.add_done_callback(lambda _: callback())

    async def step(self, output: SchedulerOutput) -> dict[str, int]:
        """Raises errors.Unavailable when the stream broke, or the worker
        answered nothing in `step_timeout_s` (a hung device or compute
        thread, behind a gRPC server that may still answer)."""
        try:
            async with _answered_within(self._step_timeout_s, "step"):
                await self._call.write(plan_to_proto(output))
                result = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(exc) from exc
        if result is grpc.aio.EOF:
            raise errors.Unavailable("worker closed the Execute stream")
        return {t.request_id: t.token_id for t in result.sampled}


class WorkerLink:
    def __init__(
        self, channel: grpc.aio.Channel, info: worker_pb2.WorkerInfo | None = None, *,
        retry_s: float = 1.0, probe_s: float = 10.0, step_timeout_s: float = STEP_TIMEOUT_S,
    ) -> None:
        """`info`: what the core was built for (None: accept any worker).
        `retry_s`: pause between GetInfo probes, and before reopening a broken
        stream; `probe_s`: bound on one probe; `step_timeout_s`: on one step,
        and on opening a stream, past which the worker counts as lost."""
        self._stub = worker_pb2_grpc.WorkerStub(channel)
        self._info = info
        self.retry_s = retry_s
        self._probe_s = probe_s
        self._step_timeout_s = step_timeout_s

    async def wait_ready(self, deadline: float | None = None) -> bool:
        """True once the worker answers GetInfo: reachable, its model loaded,
        and the model and KV layout the core was built for. False once
        `deadline` (event-loop time; None: none) passed first."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._wait_ready()
        except TimeoutError:
            return False
        return True

    async def _wait_ready(self) -> None:
        reported: list[str] = []
        while True:
            try:
                info = await self._stub.GetInfo(worker_pb2.GetInfoRequest(), wait_for_ready=True,
                                                timeout=self._probe_s)
                changed = [] if self._info is None else changed_fields(self._info, info)
                if not changed:
                    return
                if changed != reported:
                    log.error("the worker came back with another %s; not using it "
                              "(restart the scheduler to adopt it)", ", ".join(changed))
                    reported = changed
            except grpc.aio.AioRpcError as exc:
                log.debug("worker not ready (%s: %s)", exc.code().name, exc.details())
            await asyncio.sleep(self.retry_s)

    async def open(self) -> StepStream:
        """An Execute stream the worker accepted: an empty step is answered only
        then (it refuses a second scheduler), so opening a call proves nothing."""
        call = self._stub.Execute()
        try:
            async with _answered_within(self._step_timeout_s, "Execute stream"):
                await call.write(worker_pb2.StepPlan())
                if await call.read() is grpc.aio.EOF:
                    raise errors.Unavailable("worker closed the Execute stream")
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            raise _unavailable(exc) from exc
        except BaseException:
            call.cancel()
            raise
        return StepStream(call, self._step_timeout_s)

    async def offload(self, cmd: OffloadCommand, timeout_s: float) -> CopyOutcome:
        """The blocks into the cache, which keeps them by its own admission
        policy (worker.proto Offload): nothing here or in the worker says how."""
        request = worker_pb2.OffloadRequest(
            request_id=cmd.request_id, snapshot_id=cmd.snapshot_id, block_ids=cmd.block_ids,
            num_tokens=cmd.num_tokens, shared_prefix=cmd.shared_prefix)
        try:
            response = await self._stub.Offload(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return CopyOutcome(None, _describe(exc), exc.code() not in _NOT_STORED)
        except Exception as exc:  # a closed channel, ...: the put may have started
            return CopyOutcome(None, repr(exc), maybe_stored=True)
        return CopyOutcome(response.num_bytes)

    async def restore(self, cmd: RestoreCommand, timeout_s: float) -> CopyOutcome:
        request = worker_pb2.RestoreRequest(
            request_id=cmd.request_id, snapshot_id=cmd.snapshot_id, block_ids=cmd.block_ids,
            keep=cmd.keep)
        try:
            response = await self._stub.Restore(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return CopyOutcome(None, _describe(exc),
                               damaged=exc.code() is grpc.StatusCode.DATA_LOSS,
                               missing=exc.code() is grpc.StatusCode.NOT_FOUND)
        except Exception as exc:  # a closed channel, ...
            return CopyOutcome(None, repr(exc))
        return CopyOutcome(response.num_bytes)


def _describe(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"


@contextlib.asynccontextmanager
async def _answered_within(seconds: float, what: str) -> AsyncIterator[None]:
    """Unavailable where the worker has not answered `what` in `seconds`."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise errors.Unavailable(f"the worker answered no {what} in {seconds:g} s") from None


def _unavailable(exc: grpc.aio.AioRpcError) -> errors.Unavailable:
    """A broken Execute stream, whatever its status: the worker is gone for now."""
    error = errors.Unavailable(_describe(exc))
    error.code = exc.code().name
    return error
