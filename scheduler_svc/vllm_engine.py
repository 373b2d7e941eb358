"""`vllm.grpc.engine.VllmEngine` beside `kvstash.v1.Scheduler`, on the same
port: the protocol gateways such as smg (the Shepherd Model Gateway) drive
engines with, from the `smg-grpc-proto` package's generated code.

    Generate        token ids (or text) in; streamed GenerateStreamChunk
                    deltas then a GenerateComplete, or one complete
    Abort           by request ids (a gateway's client disconnected)
    HealthCheck, GetModelInfo, GetServerInfo, GetLoads
    GetTokenizer    the model's tokenizer files, zipped, SHA-256 on the last chunk
    FlushCache      forgets the prefix cache (a Cleared event)
    SubscribeKvEvents  the prefix cache's blocks stored, removed, cleared
                    (kv_event_hub.py), for cache-aware routing
    Embed, StartProfile, StopProfile: UNIMPLEMENTED, with a message

Sampling fields are mapped one by one; one kvstash cannot honour (penalties,
min_p, stop strings, logprobs, n > 1, constraints, multimodal input) is
UNIMPLEMENTED, never silently ignored. Preemption stays invisible: a
preempted request's stream only pauses.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import time
import zipfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import UTC, datetime

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from kvstash import errors, rpc
from kvstash.ids import check_request_id
from kvstash.sampling import SamplingParams
from kvstash.tokenizer import byte_tokenizer_config, byte_tokenizer_json
from scheduler_svc.backend import Backend, Timing
from scheduler_svc.core.request import RequestStatus

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
_TOKENIZER_CHUNK_BYTES = 64 * 1024
# SamplingParams fields kvstash has no counterpart for, with their neutral value.
_UNSUPPORTED_SAMPLING = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_tokens": 0,
    "include_stop_str_in_output": False, "grammar_from_first_token": False,
}


def sampling_from_vllm(params: pb.SamplingParams, num_prompt_tokens: int,
                       max_model_len: int) -> SamplingParams:
    """kvstash's sampling for a VllmEngine request; Unimplemented names a
    field it cannot honour, InvalidArgument a bad value."""
    for name, neutral in _UNSUPPORTED_SAMPLING.items():
        if getattr(params, name) != neutral:
            raise errors.Unimplemented(f"sampling_params.{name} is not supported")
    if params.repetition_penalty not in (0.0, 1.0):
        raise errors.Unimplemented("sampling_params.repetition_penalty is not supported")
    if params.stop:
        raise errors.Unimplemented("sampling_params.stop (stop strings) is not supported; "
                                   "use stop_token_ids")
    for name in ("logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
        if params.HasField(name):
            raise errors.Unimplemented(f"sampling_params.{name} is not supported")
    if params.logit_bias:
        raise errors.Unimplemented("sampling_params.logit_bias is not supported")
    if params.WhichOneof("constraint") is not None:
        raise errors.Unimplemented(
            f"sampling_params.{params.WhichOneof('constraint')} (constrained decoding) "
            "is not supported")
    if params.n > 1:
        raise errors.Unimplemented(f"sampling_params.n {params.n}: one sequence per request")
    max_tokens = (params.max_tokens if params.HasField("max_tokens")
                  else max_model_len - num_prompt_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        # Unset: vLLM's (and OpenAI's) default of 1.0; 0 is greedy.
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        seed=params.seed if params.HasField("seed") else None,
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )


def tokenizer_zip(files: Mapping[str, str]) -> bytes:
    """The tokenizer files as the zip GetTokenizer streams (flat names)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, attached: Callable[[], Backend]) -> None:
        """Serves with the backend `attached()` returns (Unavailable until the
        scheduler has one)."""
        self._attached = attached
        self._tokenizer_zip = b""
        self._started = time.monotonic()

    # -- generation ---------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        timing = Timing(time.monotonic())
        request_id = request.request_id
        try:
            check_request_id(request_id)
            backend = self._attached()
            prompt = self._prompt(request, backend)
            sampling = sampling_from_vllm(request.sampling_params, len(prompt),
                                          backend.engine.core.config.max_model_len)
            stream = await backend.admit(request_id, prompt, sampling)
        except errors.KvstashError as exc:
            await rpc.abort_with(context, exc)
        output: list[int] = []
        async for event in backend.updates(request_id, stream, timing, context):
            new = event.new_token_ids
            output.extend(new)
            if request.stream and new:
                yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
                    token_ids=new, prompt_tokens=len(prompt), completion_tokens=len(new)))
            if event.finish_status is None:
                continue
            complete = pb.GenerateComplete(
                output_ids=[] if request.stream else output,
                finish_reason=_FINISH_REASON[event.finish_status],
                prompt_tokens=len(prompt), completion_tokens=len(output))
            if event.finish_status is RequestStatus.FINISHED_STOPPED:
                complete.matched_token_id = output[-1]
            yield pb.GenerateResponse(complete=complete)

    @staticmethod
    def _prompt(request: pb.GenerateRequest, backend: Backend) -> list[int]:
        if request.mm_inputs.ByteSize() or request.extra_mm_inputs or (
                request.media_refs.ByteSize()):
            raise errors.Unimplemented("multimodal inputs are not supported")
        if request.kv_transfer_params.ByteSize() or request.HasField("kv_transfer_params_json"):
            raise errors.Unimplemented("kv_transfer_params: kvstash hands KV off itself (P/D)")
        if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
            raise errors.InvalidArgument(
                f"data_parallel_rank {request.data_parallel_rank}: this engine has rank 0 only")
        kind = request.WhichOneof("input")
        if kind == "tokenized":
            return list(request.tokenized.input_ids)
        if kind == "text":
            return backend.tokenizer.encode(request.text)
        raise errors.InvalidArgument("input is missing: set tokenized or text")

    @rpc.maps_errors
    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Aborts those of the ids that are live; unknown ones are ignored (a
        gateway aborts what may just have finished)."""
        engine = self._attached().engine
        for request_id in request.request_ids:
            check_request_id(request_id)
            with contextlib.suppress(errors.NotFound):
                engine.abort(request_id)
        return pb.AbortResponse()

    # -- what the gateway asks about the engine ------------------------------

    async def HealthCheck(self, request: pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        try:
            up = self._attached().engine.worker_up
        except errors.Unavailable as exc:
            return pb.HealthCheckResponse(healthy=False, message=str(exc))
        return pb.HealthCheckResponse(
            healthy=up, message="serving" if up else "the worker is unavailable")

    @rpc.maps_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        backend = self._attached()
        config = backend.engine.core.config
        return pb.GetModelInfoResponse(
            model_path=backend.model, served_model_name=backend.model, is_generation=True,
            max_context_length=config.max_model_len, max_req_input_len=config.max_model_len - 1,
            vocab_size=config.vocab_size, eos_token_ids=list(config.eos_token_ids),
            model_type="llama", architectures=["LlamaForCausalLM"])

    @rpc.maps_errors
    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        backend = self._attached()
        config = backend.engine.core.config
        stats = backend.engine.core.stats()
        return pb.GetServerInfoResponse(
            active_requests=stats.num_running_prefill + stats.num_running_decode
            + stats.num_waiting + stats.num_offloaded,
            uptime_seconds=time.monotonic() - self._started, server_type="vllm-grpc",
            data_parallel_size=1, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            kv_role={"mixed": "", "prefill": "kv_producer", "decode": "kv_consumer"}[backend.role])

    @rpc.maps_errors
    async def GetLoads(self, request: pb.GetLoadsRequest,
                       context: grpc.aio.ServicerContext) -> pb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            raise errors.InvalidArgument(f"dp_rank {request.dp_rank}: this engine has rank 0 only")
        backend = self._attached()
        stats = backend.engine.core.stats()
        running = stats.num_running_prefill + stats.num_running_decode
        waiting = stats.num_waiting + stats.num_offloaded
        num_free = stats.num_free_blocks + stats.num_evictable_blocks
        return pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), dp_rank_count=1, loads=[pb.SchedulerLoad(
                dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting,
                num_total_reqs=running + waiting,
                num_used_tokens=(stats.num_total_blocks - num_free) * stats.block_size,
                max_total_num_tokens=stats.num_total_blocks * stats.block_size,
                token_usage=stats.kv_usage_ratio,
                max_running_requests=backend.engine.core.config.max_num_seqs)])

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext,
                           ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        try:
            files = self._attached().tokenizer_files
        except errors.KvstashError as exc:
            await rpc.abort_with(context, exc)
        if not self._tokenizer_zip:
            self._tokenizer_zip = tokenizer_zip(files)
        data = self._tokenizer_zip
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), _TOKENIZER_CHUNK_BYTES):
            end = start + _TOKENIZER_CHUNK_BYTES
            yield common_pb2.GetTokenizerChunk(
                data=data[start:end], sha256=digest if end >= len(data) else "")

    @rpc.maps_errors
    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        engine = self._attached().engine
        freed = engine.core.reset_prefix_cache()
        engine.publish_kv_events()
        return common_pb2.FlushCacheResponse(
            success=True, message=f"prefix cache flushed ({freed} blocks freed)")

    # -- not served ----------------------------------------------------------

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext,
                                ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The prefix cache's events from batch start_sequence_number + 1 on
        (those still kept), then as they happen."""
        try:
            hub = self._attached().kv_events
        except errors.KvstashError as exc:
            await rpc.abort_with(context, exc)
        if hub is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV cache events are off")
            return
        # Headers now: a gateway counts the stream as connected only then.
        await context.send_initial_metadata(())
        async for batch in hub.subscribe(after=request.start_sequence_number):
            yield batch

    async def Embed(self, request: pb.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "kvstash serves generation only")
        raise AssertionError("unreachable")

    async def StartProfile(self, request: common_pb2.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not supported")
        raise AssertionError("unreachable")

    async def StopProfile(self, request: common_pb2.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not supported")
        raise AssertionError("unreachable")


def tokenizer_files(tokenizer_json: str, eos_token_ids: Sequence[int]) -> dict[str, str]:
    """What GetTokenizer zips for a worker's tokenizer ("" = the tiny model's
    bytes): tokenizer.json; tokenizer_config.json, which carries the tiny
    model's chat template (a checkpoint's is not passed on yet); config.json
    with the EOS ids (where gateways read them)."""
    if tokenizer_json:
        config: Mapping[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    else:
        tokenizer_json, config = byte_tokenizer_json(), byte_tokenizer_config()
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": json.dumps(config),
            "config.json": json.dumps({"eos_token_id": list(eos_token_ids)})}
