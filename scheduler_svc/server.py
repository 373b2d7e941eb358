"""`kvstash.v1.Scheduler`, the scheduler's own API: validates requests,
converts protos to domain values and back (v1_wire.py), and streams tokens
from the backend (backend.py) to clients. Served beside VllmEngine on one
port (serving.py); until the backend is attached calls answer UNAVAILABLE.
Error messages echo at most a short prefix of what a client sent
(`errors.preview`): a huge id must come back as a short INVALID_ARGUMENT.
Sampling fields left unset take the defaults VllmEngine's take (wire.py,
Room): one rule per field on both APIs.

Roles (P/D disaggregation): every role serves Generate (a prefill instance
hands the request to a decode instance and relays its tokens); ReserveBlocks
and Decode are served by a decode instance only.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace

from kvstash import errors
from kvstash.common import rpc_errors
from kvstash.common.ids import check_request_id, check_snapshot_id
from kvstash.common.sampling import Room
from kvstash.common.stats import values
from kvstash.common.tokenizer import Tokenizer, encode_text
from kvstash.common.wire import layout_from_proto, sampling_from_proto
from kvstash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.backend import Backend, Timing
from scheduler_svc.core.config import Role
from scheduler_svc.core.outputs import RequestUpdate, SchedulerStats
from scheduler_svc.core.pd import RESERVATION_RETRY_AFTER_S
from scheduler_svc.streams import RequestStream
from scheduler_svc.v1_wire import FINISH_REASON, usage_to_proto

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


def stats_to_proto(stats: SchedulerStats) -> scheduler_pb2.SchedulerStats:
    """Every declared stat (kvstash.common.stats) into the proto field of its name; a
    test keeps the two one to one, in names and types."""
    return scheduler_pb2.SchedulerStats(**values(stats))


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, attached: Callable[[], Backend]) -> None:
        """Serves with the backend `attached()` returns (Unavailable until the
        scheduler has one)."""
        self.attached = attached
        # Generate calls whose prompt is being tokenized (a long text, on a
        # thread) -> whether an Abort named them meanwhile: the core does
        # not know them yet.
        self._tokenizing: dict[str, bool] = {}

    @staticmethod
    async def _prompt_ids(request: scheduler_pb2.GenerateRequest,
                          tokenizer: Tokenizer) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return await encode_text(tokenizer, request.text)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        raise errors.InvalidArgument("prompt is missing: set text or token_ids")

    @rpc_errors.maps_errors
    async def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        timing = Timing(time.monotonic())
        request_id = request.request_id or uuid.uuid4().hex
        check_request_id(request_id)
        if request.priority:
            raise errors.InvalidArgument(
                f"priority {request.priority} is not supported: requests are admitted first "
                "come, first served; leave it 0")
        backend = self.attached()
        span = trace.get_current_span()  # the Generate span, when tracing
        if span.is_recording():
            span.set_attribute("kvstash.request_id", request_id)
        if request_id in self._tokenizing:
            raise errors.AlreadyExists(f"request {request_id} already exists")
        self._tokenizing[request_id] = False
        try:
            prompt = await self._prompt_ids(request, backend.tokenizer)
        finally:
            aborted = self._tokenizing.pop(request_id)
        sampling = sampling_from_proto(
            request.sampling, Room(len(prompt), backend.config.max_servable_len))
        stream = (RequestStream.aborted_unadmitted(request_id, len(prompt)) if aborted
                  else await backend.admit(request_id, prompt, sampling))
        async for response in self._responses(request_id, stream, timing, backend,
                                               prompt_ids=prompt):
            yield response

    @rpc_errors.maps_errors
    async def Decode(
        self, request: scheduler_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        timing = Timing(time.monotonic())
        backend = self._decode_instance()
        check_request_id(request.request_id)
        check_snapshot_id(request.snapshot_id)
        stream = backend.decode(request.request_id, request.snapshot_id,
                                       request.num_tokens, request.first_token_id)
        # Not a client's request: its prefill instance counts it (once, from
        # its client's arrival; here TTFT would time the second token).
        async for response in self._responses(request.request_id, stream, timing, backend,
                                               observed=False):
            yield response

    async def _responses(
        self, request_id: str, stream: RequestStream, timing: Timing, backend: Backend,
        observed: bool = True, prompt_ids: list[int] | None = None,
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """Its responses, their text as it reads after `prompt_ids` (None: the
        Decode of a prefill instance's request, whose text it never reads)."""
        text = backend.tokenizer.stream(prompt_ids=prompt_ids or ())
        async with contextlib.aclosing(
                backend.updates(request_id, stream, timing, observed=observed)) as updates:
            async for event in updates:
                response = scheduler_pb2.GenerateResponse(
                    request_id=request_id, token_ids=event.new_token_ids,
                    text="".join(text.push(t) for t in event.new_token_ids))
                if event.finish_status is not None:
                    self._finish(response, event, timing)
                    yield response
                elif response.token_ids:
                    yield response

    @staticmethod
    def _finish(response: scheduler_pb2.GenerateResponse, event: RequestUpdate,
                timing: Timing) -> None:
        """Completes the finishing response (and the call's span) with how it ended."""
        assert event.finish_status is not None and event.usage is not None  # sent with a finish
        usage = usage_to_proto(event.usage, timing.ttft_s)
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event("finished", {
                "kvstash.finish_reason": event.finish_status.name,
                **{f"kvstash.{f.name}": getattr(usage, f.name) for f in usage.DESCRIPTOR.fields},
            })
        response.finish_reason = FINISH_REASON[event.finish_status]
        response.usage.CopyFrom(usage)

    @rpc_errors.maps_errors
    async def Abort(
        self, request: scheduler_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.AbortResponse:
        check_request_id(request.request_id)
        backend = self.attached()
        if request.request_id not in self._tokenizing:
            backend.abort(request.request_id)
            return scheduler_pb2.AbortResponse()
        self._tokenizing[request.request_id] = True
        with contextlib.suppress(errors.NotFound):  # and one the core holds under its id
            backend.abort(request.request_id)
        return scheduler_pb2.AbortResponse()

    @rpc_errors.maps_errors
    async def ReserveBlocks(
        self, request: scheduler_pb2.ReserveBlocksRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReserveBlocksResponse:
        backend = self._decode_instance()
        check_request_id(request.request_id)
        config = backend.config
        if request.HasField("layout") and backend.kv_layout is not None:
            theirs = layout_from_proto(request.layout)
            if theirs != backend.kv_layout:
                raise errors.FailedPrecondition(
                    f"KV layout differs: the prefill instance has {theirs}, this decode "
                    f"instance {backend.kv_layout}")
        elif (request.block_size, request.bytes_per_block) != (
                config.block_size, config.bytes_per_block):
            raise errors.FailedPrecondition(
                f"KV layout differs: the prefill instance has blocks of {request.block_size} "
                f"tokens and {request.bytes_per_block} bytes, this decode instance "
                f"{config.block_size} tokens and {config.bytes_per_block} bytes")
        prompt = list(request.prompt.ids)
        sampling = sampling_from_proto(request.sampling, Room(len(prompt), config.max_servable_len))
        if backend.reserve(request.request_id, prompt, sampling):
            return scheduler_pb2.ReserveBlocksResponse(
                accepted=True, expires_in_s=config.reservation_timeout_s)
        return scheduler_pb2.ReserveBlocksResponse(
            accepted=False, retry_after_s=RESERVATION_RETRY_AFTER_S,
            reason="its worker is down" if not backend.worker_up else
            "too few free blocks or seats after the reservations of running requests")

    def _decode_instance(self) -> Backend:
        backend = self.attached()
        if backend.role is not Role.DECODE:
            raise errors.FailedPrecondition(
                f"this scheduler runs in role {backend.role.value}; only a decode instance "
                "reserves blocks and decodes for a prefill instance")
        return backend

    @rpc_errors.maps_errors
    async def GetStats(
        self, request: common_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        return stats_to_proto(self.attached().stats())
