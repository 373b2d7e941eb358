"""gRPC edge of the worker: protos in, `ModelRunner` / `KvTransfer` calls, protos out.

All model work (steps, gathers, scatters) runs on one dedicated thread, in
arrival order, so the event loop stays free to stream snapshots and answer
health checks while a step computes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import grpc

from gpu_worker.config import WorkerConfig
from gpu_worker.runner import ModelRunner, SeqWork, build_runner
from gpu_worker.sampling import GREEDY, SamplingParams
from gpu_worker.transfer import KvTransfer, SnapshotStore, layout_proto
from kvstash import errors
from kvstash.cache_client import CacheClient
from kvstash.rpc import abort_with, create_server, maps_errors
from kvstash.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=float(p.temperature),
        top_k=int(p.top_k),
        top_p=float(p.top_p) if p.top_p != 0.0 else 1.0,  # proto 0 = unset = off
        seed=int(p.seed) if p.HasField("seed") else None,
    )


def seq_from_proto(p: worker_pb2.SeqWork) -> SeqWork:
    return SeqWork(
        request_id=p.request_id,
        token_ids=list(p.token_ids),
        start_pos=int(p.start_pos),
        block_ids=list(p.block_ids),
        sample=p.sample,
        sampling=sampling_from_proto(p.sampling) if p.sample else GREEDY,
    )


def info_proto(runner: ModelRunner) -> worker_pb2.WorkerInfo:
    cfg = runner.model_config
    return worker_pb2.WorkerInfo(
        model_name=runner.name,
        vocab_size=cfg.vocab_size,
        max_model_len=runner.max_model_len,
        eos_token_ids=list(cfg.eos_token_ids),
        kv_layout=layout_proto(runner.layout),
        num_blocks=runner.num_blocks,
        device=str(runner.kv_cache.device),
        tokenizer_json=runner.tokenizer_json.encode("utf-8"),
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner, store: SnapshotStore | None,
                 cache_timeout_s: float) -> None:
        self._runner = runner
        self._store = store
        # One thread: steps, gathers and scatters are serialized by construction.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-compute")
        self._transfer = KvTransfer(runner, self._compute, store, cache_timeout_s)
        self._info = info_proto(runner)
        # One scheduler owns the KV tensor: a second Execute stream is refused.
        self._driven = False

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()
        # Not waiting: a step still running would block the event loop; its
        # thread ends on its own once the step is done.
        self._compute.shutdown(wait=False, cancel_futures=True)

    async def GetInfo(self, request: worker_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return self._info

    async def Execute(self, request_iterator: AsyncIterator[worker_pb2.StepPlan],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.StepResult]:
        if self._driven:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "another scheduler is driving this worker (one Execute stream "
                                "at a time: its block pool owns this KV cache)")
        self._driven = True
        try:
            async for result in self._execute(request_iterator, context):
                yield result
        finally:
            self._driven = False

    async def _execute(self, request_iterator: AsyncIterator[worker_pb2.StepPlan],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.StepResult]:
        loop = asyncio.get_running_loop()
        async for plan in request_iterator:
            try:
                seqs = [seq_from_proto(s) for s in plan.seqs]
                tokens = await loop.run_in_executor(self._compute, self._runner.execute, seqs)
            except errors.KvstashError as exc:
                log.warning("step %d rejected: %s", plan.step_id, exc)
                await abort_with(context, exc)
            except Exception as exc:
                log.exception("step %d failed", plan.step_id)
                await context.abort(grpc.StatusCode.INTERNAL,
                                    f"step {plan.step_id} failed: {type(exc).__name__}: {exc}")
            yield worker_pb2.StepResult(
                step_id=plan.step_id,
                sampled=[worker_pb2.SampledToken(request_id=s.request_id, token_id=t)
                         for s, t in zip(seqs, tokens, strict=True) if t is not None],
            )

    @maps_errors
    async def Offload(self, request: worker_pb2.OffloadRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.OffloadResponse:
        num_bytes = await self._transfer.offload(
            request.snapshot_id, list(request.block_ids), request.num_tokens,
            pinned=request.pinned, ttl_s=request.ttl_s,
        )
        log.info("offloaded %s: %d blocks, %d bytes", request.request_id,
                 len(request.block_ids), num_bytes)
        return worker_pb2.OffloadResponse(num_bytes=num_bytes)

    @maps_errors
    async def Restore(self, request: worker_pb2.RestoreRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.RestoreResponse:
        num_bytes = await self._transfer.restore(request.snapshot_id, list(request.block_ids))
        log.info("restored %s: %d blocks, %d bytes", request.request_id,
                 len(request.block_ids), num_bytes)
        return worker_pb2.RestoreResponse(num_bytes=num_bytes)


class WorkerServer(NamedTuple):
    server: grpc.aio.Server
    port: int
    servicer: WorkerServicer


def connect_store(config: WorkerConfig) -> SnapshotStore | None:
    if not config.cache_address:
        return None
    return CacheClient(config.cache_address, timeout_s=config.cache_timeout_s)


async def create_worker_server(config: WorkerConfig, address: str,
                               runner: ModelRunner | None = None,
                               store: SnapshotStore | None = None) -> WorkerServer:
    """Starts a Worker server on `address` (port 0 = any free). `runner` and
    `store` default to what `config` describes; tests pass their own."""
    runner = runner if runner is not None else build_runner(config)
    store = store if store is not None else connect_store(config)
    servicer = WorkerServicer(runner, store, config.cache_timeout_s)
    server, port, _ = await create_server(
        address, [lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s)],
        [SERVICE_NAME],
    )
    return WorkerServer(server, port, servicer)
