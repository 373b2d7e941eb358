"""gRPC edge of the scheduler: validates requests, converts protos to domain
values and back, and streams tokens from the engine to clients."""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict

import grpc
from opentelemetry import trace

from kvstash import errors, rpc
from kvstash.tokenizer import Tokenizer
from kvstash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.engine import Engine, RequestStream
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.request import RequestStatus, SamplingParams

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: scheduler_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: scheduler_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: scheduler_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(proto: common_pb2.SamplingParams) -> SamplingParams:
    """Converts only: the core's admission checks validate every value."""
    return SamplingParams(
        max_tokens=proto.max_tokens,
        temperature=proto.temperature,
        top_p=proto.top_p or 1.0,  # proto3's 0 means unset
        top_k=proto.top_k,
        seed=proto.seed if proto.HasField("seed") else None,
        stop_token_ids=tuple(proto.stop_token_ids),
        ignore_eos=proto.ignore_eos,
    )


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: SchedulerMetrics) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._metrics = metrics

    def _prompt_ids(self, request: scheduler_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return self._tokenizer.encode(request.text)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        raise errors.InvalidArgument("prompt is missing: set text or token_ids")

    async def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        arrival = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            if not _REQUEST_ID.fullmatch(request_id):
                raise errors.InvalidArgument(
                    f"request_id must be 1-128 chars of [A-Za-z0-9._:-], got {request_id!r}")
            span = trace.get_current_span()  # the Generate span, when tracing
            if span.is_recording():
                span.set_attribute("kvstash.request_id", request_id)
            stream = self._engine.submit(
                request_id, self._prompt_ids(request), sampling_from_proto(request.sampling))
        except errors.KvstashError as exc:
            await rpc.abort_with(context, exc)
        try:
            async for response in self._responses(request_id, stream, arrival, context):
                yield response
        finally:
            if not stream.finished:  # the client went away: free everything now
                with contextlib.suppress(errors.NotFound):
                    self._engine.abort(request_id)

    async def _responses(
        self, request_id: str, stream: RequestStream, arrival: float,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        text = self._tokenizer.stream()
        ttft_s = 0.0
        while True:
            event = await stream.events.get()
            if isinstance(event, errors.KvstashError):
                await rpc.abort_with(context, event)
            if event.new_token_ids and not ttft_s:
                ttft_s = time.monotonic() - arrival
            response = scheduler_pb2.GenerateResponse(
                request_id=request_id,
                token_ids=event.new_token_ids,
                text="".join(text.push(t) for t in event.new_token_ids),
            )
            if event.finish_status is not None:
                req = stream.request
                self._observe_latency(arrival, ttft_s, len(req.output_token_ids))
                span = trace.get_current_span()
                if span.is_recording():
                    span.add_event("finished", {
                        "kvstash.finish_reason": event.finish_status.name,
                        "kvstash.prompt_tokens": len(req.prompt_token_ids),
                        "kvstash.completion_tokens": len(req.output_token_ids),
                        "kvstash.num_preemptions": req.num_preemptions,
                        "kvstash.num_recomputed_tokens": req.num_recomputed_tokens,
                        "kvstash.bytes_offloaded": req.bytes_offloaded,
                        "kvstash.ttft_s": ttft_s,
                    })
                response.finish_reason = _FINISH_REASON[event.finish_status]
                response.usage.CopyFrom(scheduler_pb2.Usage(
                    prompt_tokens=len(req.prompt_token_ids),
                    completion_tokens=len(req.output_token_ids),
                    num_preemptions=req.num_preemptions,
                    num_recomputed_tokens=req.num_recomputed_tokens,
                    bytes_offloaded=req.bytes_offloaded,
                    ttft_s=ttft_s,
                ))
                yield response
                return
            if response.token_ids:
                yield response

    def _observe_latency(self, arrival: float, ttft_s: float, num_tokens: int) -> None:
        if not ttft_s:
            return
        self._metrics.ttft_s.observe(ttft_s)
        if num_tokens > 1:
            decode_s = time.monotonic() - arrival - ttft_s
            self._metrics.tpot_s.observe(decode_s / (num_tokens - 1))

    @rpc.maps_errors
    async def Abort(
        self, request: scheduler_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.AbortResponse:
        self._engine.abort(request.request_id)
        return scheduler_pb2.AbortResponse()

    async def GetStats(
        self, request: common_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        return scheduler_pb2.SchedulerStats(**asdict(self._engine.core.stats()))


async def create_scheduler_server(
    engine: Engine, tokenizer: Tokenizer, metrics: SchedulerMetrics, address: str
) -> tuple[grpc.aio.Server, int]:
    servicer = SchedulerServicer(engine, tokenizer, metrics)
    server, port, _ = await rpc.create_server(
        address,
        [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, s)],
        [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name],
    )
    return server, port
