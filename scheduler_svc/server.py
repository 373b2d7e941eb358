"""gRPC edge of the scheduler: validates requests, converts protos to domain
values and back, and streams tokens from the engine to clients.

Start-up order: bind, then find the worker, then `attach` the engine. Until
then Scheduler calls answer UNAVAILABLE; health answers NOT_SERVING (for ""
and the Scheduler service) whenever the engine has no worker (`set_serving`).
Error messages echo at most a short prefix of what a client sent
(`errors.preview`): a huge id must come back as a short INVALID_ARGUMENT.

Roles (P/D disaggregation): every role serves Generate; a prefill instance
first has a decode instance reserve blocks for the request (the engine's
`find_decoder`) and relays its tokens. ReserveBlocks and Decode are served
by a decode instance only.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health
from opentelemetry import trace
from smg_grpc_proto import vllm_engine_pb2_grpc

from kvstash import errors, rpc
from kvstash.ids import check_request_id, check_snapshot_id
from kvstash.security import PLAINTEXT, Security
from kvstash.stats import values
from kvstash.tokenizer import Tokenizer
from kvstash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from kvstash.wire import sampling_from_proto
from scheduler_svc.backend import Backend, Timing
from scheduler_svc.core.outputs import RequestUpdate, SchedulerStats
from scheduler_svc.core.request import RequestStatus, RequestUsage
from scheduler_svc.streams import RequestStream
from scheduler_svc.vllm_engine import SERVICE_NAME as VLLM_SERVICE_NAME
from scheduler_svc.vllm_engine import VllmEngineServicer

log = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
ROLES = ("mixed", "prefill", "decode")
# What a refused ReserveBlocks suggests: a decode step or two frees blocks.
RETRY_AFTER_S = 0.05
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: scheduler_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: scheduler_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: scheduler_pb2.FINISH_REASON_ABORT,
}


def stats_to_proto(stats: SchedulerStats) -> scheduler_pb2.SchedulerStats:
    """Every declared stat (kvstash.stats) into the proto field of its name; a
    test keeps the two one to one, in names and types."""
    return scheduler_pb2.SchedulerStats(**values(stats))


def usage_to_proto(usage: RequestUsage, ttft_s: float) -> scheduler_pb2.Usage:
    return scheduler_pb2.Usage(
        prompt_tokens=usage.num_prompt_tokens, completion_tokens=usage.num_output_tokens,
        num_preemptions=usage.num_preemptions, num_recomputed_tokens=usage.num_recomputed_tokens,
        bytes_offloaded=usage.bytes_offloaded, ttft_s=ttft_s,
    )


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self._backend: Backend | None = None

    def attach(self, backend: Backend) -> None:
        """Starts serving calls with `backend`, in its role (ROLES)."""
        if backend.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {backend.role!r}")
        self._backend = backend

    def attached(self) -> Backend:
        if self._backend is None:
            raise errors.Unavailable("the scheduler is still waiting for its worker")
        return self._backend

    @staticmethod
    def _prompt_ids(request: scheduler_pb2.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return tokenizer.encode(request.text)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        raise errors.InvalidArgument("prompt is missing: set text or token_ids")

    @rpc.maps_errors
    async def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        timing = Timing(time.monotonic())
        request_id = request.request_id or uuid.uuid4().hex
        check_request_id(request_id)
        backend = self.attached()
        span = trace.get_current_span()  # the Generate span, when tracing
        if span.is_recording():
            span.set_attribute("kvstash.request_id", request_id)
        stream = await backend.admit(request_id, self._prompt_ids(request, backend.tokenizer),
                                     sampling_from_proto(request.sampling))
        async for response in self._responses(request_id, stream, timing, backend):
            yield response

    @rpc.maps_errors
    async def Decode(
        self, request: scheduler_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        timing = Timing(time.monotonic())
        backend = self._decode_instance()
        check_request_id(request.request_id)
        check_snapshot_id(request.snapshot_id)
        stream = backend.engine.decode(request.request_id, request.snapshot_id,
                                       request.num_tokens, request.first_token_id)
        async for response in self._responses(request.request_id, stream, timing, backend):
            yield response

    async def _responses(
        self, request_id: str, stream: RequestStream, timing: Timing, backend: Backend,
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        text = backend.tokenizer.stream()
        async with contextlib.aclosing(backend.updates(request_id, stream, timing)) as updates:
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
        response.finish_reason = _FINISH_REASON[event.finish_status]
        response.usage.CopyFrom(usage)

    @rpc.maps_errors
    async def Abort(
        self, request: scheduler_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.AbortResponse:
        check_request_id(request.request_id)
        self.attached().engine.abort(request.request_id)
        return scheduler_pb2.AbortResponse()

    @rpc.maps_errors
    async def ReserveBlocks(
        self, request: scheduler_pb2.ReserveBlocksRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReserveBlocksResponse:
        backend = self._decode_instance()
        check_request_id(request.request_id)
        config = backend.engine.core.config
        if (request.block_size, request.bytes_per_block) != (
                config.block_size, config.bytes_per_block):
            raise errors.FailedPrecondition(
                f"KV layout differs: the prefill instance has blocks of {request.block_size} "
                f"tokens and {request.bytes_per_block} bytes, this decode instance "
                f"{config.block_size} tokens and {config.bytes_per_block} bytes")
        if backend.engine.reserve(request.request_id, list(request.prompt.ids),
                                  sampling_from_proto(request.sampling)):
            return scheduler_pb2.ReserveBlocksResponse(
                accepted=True, expires_in_s=config.reservation_timeout_s)
        return scheduler_pb2.ReserveBlocksResponse(
            accepted=False, retry_after_s=RETRY_AFTER_S,
            reason="too few free blocks or seats after the reservations of running requests")

    def _decode_instance(self) -> Backend:
        backend = self.attached()
        if backend.role != "decode":
            raise errors.FailedPrecondition(
                f"this scheduler runs in role {backend.role}; only a decode instance "
                "reserves blocks and decodes for a prefill instance")
        return backend

    @rpc.maps_errors
    async def GetStats(
        self, request: common_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        return stats_to_proto(self.attached().engine.core.stats())


@dataclass(slots=True)
class SchedulerServer:
    server: grpc.aio.Server
    port: int
    servicer: SchedulerServicer
    health: health.aio.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        """What the health service answers for "" and both public services."""
        await rpc.set_serving(self.health, [SERVICE_NAME, VLLM_SERVICE_NAME], serving)


async def create_scheduler_server(
    address: str, security: Security = PLAINTEXT,
    connections: rpc.Connections = rpc.DEFAULT_CONNECTIONS,
) -> SchedulerServer:
    """Binds and starts serving (TLS and tokens as `security` says),
    NOT_SERVING until an engine is attached and reports its worker up."""
    servicer = SchedulerServicer()
    vllm = VllmEngineServicer(servicer.attached)
    server, port, health_servicer = await rpc.create_server(
        address,
        [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, s),
         lambda s: vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm, s)],
        [SERVICE_NAME, VLLM_SERVICE_NAME], serving=False, security=security,
        connections=connections,
    )
    return SchedulerServer(server, port, servicer, health_servicer)
