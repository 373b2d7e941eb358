"""What a gateway asks a VllmEngine about the engine, beside generation
(vllm_engine.py), and the tokenizer files it hands out.

    HealthCheck     whether the worker is up
    GetModelInfo    the model, and the context length this instance serves
    GetServerInfo, GetLoads  what runs and waits, and how full the KV pool is
    GetTokenizer    the model's tokenizer files, zipped, SHA-256 on the last chunk
    FlushCache      forgets the prefix cache (a Cleared event)
    SubscribeKvEvents  the prefix cache's blocks stored, removed, cleared
                    (kv_event_hub.py), for cache-aware routing
    Embed, StartProfile, StopProfile: UNIMPLEMENTED, with a message
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import time
import zipfile
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC, datetime

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from kvstash import errors
from kvstash.common import rpc_errors
from scheduler_svc.backend import Backend

_TOKENIZER_CHUNK_BYTES = 64 * 1024


def package_version() -> str:
    """The installed kvstash's version; a source tree run without installing
    (PYTHONPATH=., as on a lent GPU machine) has no package metadata."""
    try:
        return importlib.metadata.version("kvstash")
    except importlib.metadata.PackageNotFoundError:
        return "(source tree)"


class VllmInfo(vllm_engine_pb2_grpc.VllmEngineServicer):
    """The informational VllmEngine RPCs; VllmEngineServicer adds generation."""

    def __init__(self, attached: Callable[[], Backend]) -> None:
        """Serves with the backend `attached()` returns (Unavailable until the
        scheduler has one)."""
        self._attached = attached
        self._tokenizer_zip = b""
        self._started = time.monotonic()
        self._version = f"kvstash {package_version()}"

    @rpc_errors.maps_errors
    async def HealthCheck(self, request: pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        try:
            up = self._attached().worker_up
        except errors.Unavailable as exc:
            return pb.HealthCheckResponse(healthy=False, message=str(exc))
        return pb.HealthCheckResponse(
            healthy=up, message="serving" if up else "the worker is unavailable")

    @rpc_errors.maps_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        """The context length is what this instance serves: max_model_len, or
        less where its KV pool holds fewer tokens."""
        backend = self._attached()
        config = backend.config
        max_len = config.max_servable_len
        return pb.GetModelInfoResponse(
            model_path=backend.model, served_model_name=backend.model, is_generation=True,
            max_context_length=max_len, max_req_input_len=max_len - 1,
            vocab_size=config.vocab_size, eos_token_ids=list(config.eos_token_ids),
            model_type=backend.model_type, architectures=list(backend.architectures))

    @rpc_errors.maps_errors
    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        """No kv_connector, no kv_role, whatever this instance's P/D role:
        kvstash hands KV off itself, so a gateway must not pair its instances
        as vLLM prefill and decode workers."""
        backend = self._attached()
        config = backend.config
        stats = backend.stats()
        return pb.GetServerInfoResponse(
            active_requests=stats.num_running_prefill + stats.num_running_decode
            + stats.num_loading + stats.num_waiting + stats.num_offloaded,
            uptime_seconds=time.monotonic() - self._started, server_type="vllm-grpc",
            data_parallel_size=1, block_size=config.block_size, max_num_seqs=config.max_num_seqs)

    @rpc_errors.maps_errors
    async def GetLoads(self, request: pb.GetLoadsRequest,
                       context: grpc.aio.ServicerContext) -> pb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            raise errors.InvalidArgument(f"dp_rank {request.dp_rank}: this engine has rank 0 only")
        backend = self._attached()
        stats = backend.stats()
        running = stats.num_running_prefill + stats.num_running_decode + stats.num_loading
        waiting = stats.num_waiting + stats.num_offloaded
        num_free = stats.num_free_blocks + stats.num_evictable_blocks
        return pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version=self._version, dp_rank_count=1,
            loads=[pb.SchedulerLoad(
                dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting,
                num_total_reqs=running + waiting,
                num_used_tokens=(stats.num_total_blocks - num_free) * stats.block_size,
                max_total_num_tokens=stats.num_total_blocks * stats.block_size,
                token_usage=stats.kv_usage_ratio,
                max_running_requests=backend.config.max_num_seqs)])

    @rpc_errors.maps_errors
    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext,
                           ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        files = self._attached().tokenizer_files
        if not self._tokenizer_zip:
            self._tokenizer_zip = tokenizer_zip(files)
        data = self._tokenizer_zip
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), _TOKENIZER_CHUNK_BYTES):
            end = start + _TOKENIZER_CHUNK_BYTES
            yield common_pb2.GetTokenizerChunk(
                data=data[start:end], sha256=digest if end >= len(data) else "")

    @rpc_errors.maps_errors
    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        freed = self._attached().flush_prefix_cache()
        return common_pb2.FlushCacheResponse(
            success=True, message=f"prefix cache flushed ({freed} blocks freed)")

    @rpc_errors.maps_errors
    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext,
                                ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The prefix cache's events from batch start_sequence_number + 1 on
        (those still kept), then as they happen."""
        hub = self._attached().kv_events
        if hub is None:
            raise errors.Unimplemented("KV cache events are off")
        # Headers now: a gateway counts the stream as connected only then.
        await context.send_initial_metadata(())
        async for batch in hub.subscribe(after=request.start_sequence_number):
            yield batch

    # -- not served ----------------------------------------------------------

    @rpc_errors.maps_errors
    async def Embed(self, request: pb.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        raise errors.Unimplemented("kvstash serves generation only")

    @rpc_errors.maps_errors
    async def StartProfile(self, request: common_pb2.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        raise errors.Unimplemented("profiling is not supported")

    @rpc_errors.maps_errors
    async def StopProfile(self, request: common_pb2.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        raise errors.Unimplemented("profiling is not supported")


def tokenizer_zip(files: Mapping[str, str]) -> bytes:
    """The tokenizer files as the zip GetTokenizer streams (flat names)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()
