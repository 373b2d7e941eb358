"""gRPC edge of the worker: protos in, `ModelRunner` / `KvTransfer` calls, protos out.

All model work (loading, steps, gathers, scatters) runs on one dedicated
thread, in arrival order, so the event loop stays free to stream snapshots and
answer health checks while a step computes or the model loads.

Start-up order: bind, then load. Until the model is loaded, health answers
NOT_SERVING (for "" and the Worker service), so a readiness probe can tell a
worker that is starting from one that is gone; GetInfo waits for the model
(within the caller's deadline, as `wait_for_ready` waits for the port) and the
other Worker calls fail UNAVAILABLE.

Offload and Restore bound their cache calls by the caller's deadline
(`context.time_remaining()`, less a margin: see _deadline), so one transfer
has one deadline end to end; `cache_timeout_s` applies only to calls sent
without one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import grpc
from grpc_health.v1 import health

from gpu_worker.config import WorkerConfig
from gpu_worker.hf_config import ARCHITECTURES
from gpu_worker.metrics import WorkerMetrics
from gpu_worker.runner import ModelRunner, SeqWork, build_runner
from gpu_worker.transfer import KvTransfer, SnapshotClient
from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common.ids import check_request_id, check_snapshot_id
from kvstash.common.metrics import MetricsServer
from kvstash.common.rpc_connections import MAX_STEP_PLAN_BYTES, MAX_WORKER_INFO_BYTES
from kvstash.common.rpc_errors import maps_errors
from kvstash.common.rpc_server import create_server, set_serving
from kvstash.common.sampling import GREEDY
from kvstash.common.wire import layout_to_proto, sampling_from_proto
from kvstash.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# A copy's deadline here is the caller's less this share of it, at least
# _MIN_MARGIN_S: see WorkerServicer._deadline.
_MARGIN = 0.05
_MIN_MARGIN_S = 0.05


def seq_from_proto(p: worker_pb2.SeqWork) -> SeqWork:
    """Raises InvalidArgument naming a bad request id, or a bad sampling value
    of a sampling chunk (the sampling of a chunk that samples nothing is not
    read)."""
    check_request_id(p.request_id)  # the rule of every service: errors and logs name it
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
        kv_layout=layout_to_proto(runner.layout),
        num_blocks=runner.num_blocks,
        device=str(runner.kv_cache.device),
        tokenizer_json=runner.tokenizer_json.encode("utf-8"),
        tokenizer_config_json=runner.tokenizer_config_json.encode("utf-8"),
        model_type=cfg.model_type,
        architectures=[ARCHITECTURES[cfg.model_type]],
        weights_id=runner.weights_id,
        numerics=runner.batched.numerics,
    )


class _Model(NamedTuple):
    """What the Worker calls need once the model is loaded."""

    runner: ModelRunner
    transfer: KvTransfer
    info: worker_pb2.WorkerInfo


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, cache: SnapshotClient | None, cache_timeout_s: float,
                 metrics: WorkerMetrics) -> None:
        self._cache = cache
        self._cache_timeout_s = cache_timeout_s  # for transfers sent without a deadline
        self._metrics = metrics
        # One thread: loading, steps, gathers and scatters are serialized by construction.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-compute")
        self._model: _Model | None = None  # None while the model loads
        self._model_ready = asyncio.Event()
        # One scheduler owns the KV tensor: a second Execute stream is refused.
        self._driven = False

    def attach(self, runner: ModelRunner) -> None:
        """Starts serving Worker calls with `runner`."""
        transfer = KvTransfer(runner, self._compute, self._cache)
        self._model = _Model(runner, transfer, info_proto(runner))
        self._model_ready.set()
        log.info("model %s ready: %s on %s, %d KV blocks of %d tokens", runner.name,
                 runner.layout.dtype, runner.device, runner.num_blocks, runner.block_size)

    async def load(self, build: Callable[[], ModelRunner]) -> None:
        """Runs `build` on the compute thread, then serves with its runner."""
        loop = asyncio.get_running_loop()
        self.attach(await loop.run_in_executor(self._compute, build))

    def _loaded(self) -> _Model:
        if self._model is None:
            raise errors.Unavailable("the worker is still loading its model")
        return self._model

    async def close(self) -> None:
        if self._cache is not None:
            await self._cache.close()
        # Not waiting: a step still running would block the event loop; its
        # thread ends on its own once the step is done.
        self._compute.shutdown(wait=False, cancel_futures=True)

    @maps_errors
    async def GetInfo(self, request: worker_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        await self._model_ready.wait()
        return self._loaded().info

    @maps_errors
    async def Execute(self, request_iterator: AsyncIterator[worker_pb2.StepPlan],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.StepResult]:
        runner = self._loaded().runner
        if self._driven:
            raise errors.FailedPrecondition(
                "another scheduler is driving this worker (one Execute stream at a time: its "
                "block pool owns this KV cache)")
        self._driven = True
        try:
            async for result in self._execute(runner, request_iterator, context):
                yield result
        finally:
            self._driven = False

    def _step(self, runner: ModelRunner, seqs: Sequence[SeqWork]) -> list[int | None]:
        """One step, timed on the compute thread (not counting time queued behind
        other work there)."""
        start = time.perf_counter()
        tokens = runner.execute(seqs)
        if seqs:
            self._metrics.observe_step(seqs, time.perf_counter() - start)
        return tokens

    async def _execute(self, runner: ModelRunner,
                       request_iterator: AsyncIterator[worker_pb2.StepPlan],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.StepResult]:
        loop = asyncio.get_running_loop()
        async for plan in request_iterator:
            try:
                seqs = [seq_from_proto(s) for s in plan.seqs]
                tokens = await loop.run_in_executor(self._compute, self._step, runner, seqs)
            except errors.KvstashError as exc:
                log.warning("step %d rejected: %s", plan.step_id, exc)
                raise
            yield worker_pb2.StepResult(
                step_id=plan.step_id,
                sampled=[worker_pb2.SampledToken(request_id=s.request_id, token_id=t)
                         for s, t in zip(seqs, tokens, strict=True) if t is not None],
            )

    @maps_errors
    async def Offload(self, request: worker_pb2.OffloadRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.OffloadResponse:
        check_request_id(request.request_id)
        check_snapshot_id(request.snapshot_id)
        deadline = self._deadline(context)
        transfer = self._loaded().transfer
        start = time.perf_counter()
        num_bytes = await transfer.offload(
            request.snapshot_id, request.block_ids, request.num_tokens, deadline,
            request.shared_prefix)
        self._metrics.observe_offload(num_bytes, time.perf_counter() - start)
        log.info("offloaded %s: %d blocks, %d bytes", request.request_id,
                 len(request.block_ids), num_bytes)
        return worker_pb2.OffloadResponse(num_bytes=num_bytes)

    @maps_errors
    async def Restore(self, request: worker_pb2.RestoreRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.RestoreResponse:
        check_request_id(request.request_id)
        check_snapshot_id(request.snapshot_id)
        deadline = self._deadline(context)
        transfer = self._loaded().transfer
        start = time.perf_counter()
        num_bytes = await transfer.restore(request.snapshot_id, request.block_ids,
                                           deadline, request.keep)
        self._metrics.observe_restore(num_bytes, time.perf_counter() - start)
        log.info("restored %s: %d blocks, %d bytes", request.request_id,
                 len(request.block_ids), num_bytes)
        return worker_pb2.RestoreResponse(num_bytes=num_bytes)

    def _deadline(self, context: grpc.aio.ServicerContext) -> float:
        """When this call's cache transfer must be done, in event-loop time:
        a margin before the caller's deadline, or cache_timeout_s from now if
        it sent none. The deadline as it arrives ends after the caller's (by
        the call's transit, and gRPC rounds the timeout it sends up, 60 s to
        60.1), and a copy that committed in between (consumed its snapshot,
        stored a put) would be one the caller already saw fail."""
        remaining = context.time_remaining()
        budget = (self._cache_timeout_s if remaining is None
                  else remaining - max(_MARGIN * remaining, _MIN_MARGIN_S))
        return asyncio.get_running_loop().time() + budget


class WorkerServer(NamedTuple):
    server: grpc.aio.Server
    port: int
    servicer: WorkerServicer
    loaded: asyncio.Future[None]  # done once Worker calls are served; holds a load error
    metrics: WorkerMetrics
    metrics_server: MetricsServer | None  # None = --metrics-port 0

    async def close(self) -> None:
        """Releases what the server holds besides its port (call after server.stop)."""
        await self.servicer.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()


def connect_cache(config: WorkerConfig) -> SnapshotClient | None:
    """A client of the cache service `config` names; None if it names none.
    Its calls get their deadlines from each Offload and Restore."""
    if not config.cache_address:
        return None
    return CacheClient(config.cache_address, use_arena=config.cache_arena,
                       security=config.security)


async def _serve_once_loaded(servicer: WorkerServicer, health_servicer: health.aio.HealthServicer,
                             build: Callable[[], ModelRunner]) -> None:
    await servicer.load(build)
    await set_serving(health_servicer, [SERVICE_NAME], True)


async def create_worker_server(config: WorkerConfig, address: str,
                               runner: ModelRunner | None = None,
                               cache: SnapshotClient | None = None) -> WorkerServer:
    """Starts a Worker server on `address` (port 0 = any free) and, unless a
    `runner` is given (tests), starts loading the model `config` names; await
    `loaded` for it. `cache` defaults to the cache service `config` names."""
    cache = cache if cache is not None else connect_cache(config)
    metrics = WorkerMetrics()
    servicer = WorkerServicer(cache, config.cache_timeout_s, metrics)
    metrics_server = (MetricsServer(metrics.registry, config.metrics_port, config.metrics_host)
                      if config.metrics_port else None)
    try:
        server, port, health_servicer = await create_server(
            address, [lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s)],
            [SERVICE_NAME], serving=runner is not None, security=config.security,
            connections=config.connections,
            options=[("grpc.max_send_message_length", MAX_WORKER_INFO_BYTES),
                     ("grpc.max_receive_message_length", MAX_STEP_PLAN_BYTES)],
        )
    except BaseException:
        if metrics_server is not None:
            metrics_server.stop()
        raise
    loaded: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    if runner is not None:
        servicer.attach(runner)
        loaded.set_result(None)
    else:
        loaded = asyncio.ensure_future(
            _serve_once_loaded(servicer, health_servicer, lambda: build_runner(config)))
    return WorkerServer(server, port, servicer, loaded, metrics, metrics_server)
