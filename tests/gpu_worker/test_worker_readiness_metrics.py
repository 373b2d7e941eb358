"""Health follows the model's loading; /metrics reports steps and transfers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_svc.config import CacheConfig
from cache_svc.server import create_cache_server
from gpu_worker import server as worker_server
from gpu_worker.config import WorkerConfig
from gpu_worker.runner import ModelRunner, SeqWork
from kvstash.common.binding import free_port
from kvstash.common.rpc_connections import insecure_channel
from kvstash.common.units import MIB
from kvstash.v1 import worker_pb2, worker_pb2_grpc
from tests.gpu_worker.test_worker_server import run_steps
from tests.gpu_worker.worker_factories import make_runner, worker_process
from tests.metrics_helpers import scrape

REPO = Path(__file__).resolve().parents[2]
SERVING, NOT_SERVING = (health_pb2.HealthCheckResponse.SERVING,
                        health_pb2.HealthCheckResponse.NOT_SERVING)
NAMES = ("", worker_server.SERVICE_NAME)


async def health_of(channel: grpc.aio.Channel) -> list[int]:
    stub = health_pb2_grpc.HealthStub(channel)
    return [(await stub.Check(health_pb2.HealthCheckRequest(service=n))).status for n in NAMES]


async def test_not_serving_until_the_model_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def slow_build(config: WorkerConfig) -> ModelRunner:
        assert release.wait(30)
        return make_runner()

    monkeypatch.setattr(worker_server, "build_runner", slow_build)
    worker = await worker_server.create_worker_server(WorkerConfig(), "127.0.0.1:0")
    try:
        async with insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            assert await health_of(channel) == [NOT_SERVING, NOT_SERVING]
            # GetInfo waits for the model (a scheduler started alongside gets
            # it once loaded); calls that need the KV cache are refused.
            pending_info = asyncio.ensure_future(
                stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=30))
            calls: list[Callable[[], object]] = [
                lambda: stub.Offload(worker_pb2.OffloadRequest(
                    request_id="a", snapshot_id="s", block_ids=[0], num_tokens=1)),
                lambda: stub.Execute(iter([worker_pb2.StepPlan()])).read(),
            ]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call()  # type: ignore[misc]
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "still loading its model" in (info.value.details() or "")
            assert not worker.loaded.done() and not pending_info.done()
            release.set()
            await asyncio.wait_for(worker.loaded, 30)
            assert await health_of(channel) == [SERVING, SERVING]
            assert (await pending_info).num_blocks == 64
    finally:
        release.set()
        await worker.server.stop(None)
        await worker.close()


async def test_a_failed_load_stays_not_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_build(config: WorkerConfig) -> ModelRunner:
        raise ValueError("checkpoint does not match config.json")

    monkeypatch.setattr(worker_server, "build_runner", broken_build)
    worker = await worker_server.create_worker_server(WorkerConfig(), "127.0.0.1:0")
    try:
        with pytest.raises(ValueError, match="does not match"):
            await worker.loaded
        async with insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            assert await health_of(channel) == [NOT_SERVING, NOT_SERVING]
    finally:
        await worker.server.stop(None)
        await worker.close()


async def test_real_worker_is_serving_once_ready_and_exports_metrics() -> None:
    _, cache_port, cache = await create_cache_server(
        CacheConfig(memory_budget_bytes=16 * MIB), "127.0.0.1:0")
    metrics_port = free_port()
    try:
        async with worker_process(
            "--block-size", "4", "--num-blocks", "64", "--cache-address",
            f"127.0.0.1:{cache_port}", "--metrics-port", str(metrics_port),
            "--metrics-host", "127.0.0.1",
        ) as worker:
            async with insecure_channel(worker.address) as channel:
                assert await health_of(channel) == [SERVING, SERVING]
                stub = worker_pb2_grpc.WorkerStub(channel)
                a, b = list(b"ten tokens"), list(b"six!!!")
                steps = [[SeqWork("a", a, 0, [0, 1, 2, 3], True),
                          SeqWork("b", b, 0, [8, 9, 10], True)]]
                steps += [[SeqWork("a", [65], len(a) + i, [0, 1, 2, 3], True),
                           SeqWork("b", [66], len(b) + i, [8, 9, 10], True)] for i in range(3)]
                await run_steps(stub, steps)
                off = await stub.Offload(worker_pb2.OffloadRequest(
                    request_id="a", snapshot_id="snap-a", block_ids=[0, 1, 2, 3], num_tokens=13))
                back = await stub.Restore(worker_pb2.RestoreRequest(
                    request_id="a", snapshot_id="snap-a", block_ids=[20, 21, 22, 23]))
            m = await asyncio.to_thread(scrape, metrics_port)
            assert m["kvstash_worker_step_seconds_count"] == 4
            assert 0 < m["kvstash_worker_step_seconds_sum"] < 60
            assert m["kvstash_worker_step_sequences_count"] == 4
            assert m["kvstash_worker_step_sequences_sum"] == 8
            assert m["kvstash_worker_prefill_tokens_total"] == len(a) + len(b)
            assert m["kvstash_worker_decode_tokens_total"] == 6
            # Tiny model, dtype auto = float64: 4 layers * 2 * 4 tokens * 2 heads * 32 * 8 bytes.
            assert off.num_bytes == back.num_bytes == 4 * 16384
            assert m["kvstash_worker_offload_bytes_total"] == off.num_bytes
            assert m["kvstash_worker_restore_bytes_total"] == back.num_bytes
            for kind in ("offload", "restore"):
                assert m[f"kvstash_worker_{kind}_seconds_count"] == 1
                assert 0 < m[f"kvstash_worker_{kind}_seconds_sum"] < 60
            # Bound to the chosen address only: another loopback address is refused.
            with pytest.raises(OSError):
                await asyncio.to_thread(scrape, metrics_port, "127.0.0.2")
    finally:
        await cache.stop(None)
