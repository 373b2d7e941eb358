"""Every service serves the standard gRPC health service and server reflection,
and the scheduler's health follows reality: NOT_SERVING without a worker,
SERVING (degraded, shown in its stats) without a cache."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstash.client import Client
from kvstash.common import rpc_connections
from kvstash.common.binding import free_port
from kvstash.launch.stack import Stack, StackConfig, running_stack

SERVICES = {
    "scheduler": "kvstash.v1.Scheduler",
    "worker": "kvstash.v1.Worker",
    "cache": "kvstash.v1.KVCache",
}


@pytest.mark.parametrize("name", SERVICES)
async def test_health_and_reflection(stack: Stack, name: str) -> None:
    address = getattr(stack, name).address
    async with rpc_connections.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICES[name]):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = reflection.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        reply = await call.read()
        await call.done_writing()
    names = {s.name for s in reply.list_services_response.service}
    assert {SERVICES[name], "grpc.health.v1.Health"} <= names


SERVING = {health_pb2.HealthCheckResponse.SERVING}
NOT_SERVING = {health_pb2.HealthCheckResponse.NOT_SERVING}


async def _scheduler_statuses(channel: grpc.aio.Channel) -> set[int]:
    health = health_pb2_grpc.HealthStub(channel)
    return {(await health.Check(health_pb2.HealthCheckRequest(service=s))).status
            for s in ("", SERVICES["scheduler"])}


async def _eventually(check: Callable[[], Awaitable[bool]], timeout_s: float) -> float:
    """Seconds until `check()` holds; fails after `timeout_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not await check():
        assert loop.time() - start < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.1)
    return loop.time() - start


async def test_scheduler_health_follows_its_worker_not_its_cache(tmp_path: Path) -> None:
    # Before: SERVING throughout, with the worker dead and with the cache gone.
    with running_stack(StackConfig(num_blocks=64), tmp_path) as stack:
        async with rpc_connections.insecure_channel(stack.address) as channel, \
                Client(stack.address) as client:
            assert await _scheduler_statuses(channel) == SERVING
            await _eventually(lambda: _cache_available(client, True), 5)

            stack.worker.kill()
            await _eventually(lambda: _statuses_are(channel, NOT_SERVING), 5)
            stack.worker = stack.worker.restart()
            await _eventually(lambda: _statuses_are(channel, SERVING), 30)
            assert (await client.complete([1, 2, 3], max_tokens=4, ignore_eos=True)).token_ids

            # A lost cache degrades offload to recompute: still SERVING.
            stack.cache.kill()
            await _eventually(lambda: _cache_available(client, False), 5)
            await asyncio.sleep(1.5)  # three more polls, still unreachable
            assert await _scheduler_statuses(channel) == SERVING
            assert (await client.complete([1, 2, 3], max_tokens=4, ignore_eos=True)).token_ids
    log = stack.scheduler.log_path.read_text()
    assert log.count("unreachable") == 1, log  # once per change, not once per poll


async def test_a_worker_back_with_another_kv_layout_is_not_used(tmp_path: Path) -> None:
    # The core's block pool was sized for the first worker: a worker with
    # fewer blocks would be handed block ids it does not have.
    with running_stack(StackConfig(num_blocks=64), tmp_path) as stack:
        async with rpc_connections.insecure_channel(stack.address) as channel, \
                Client(stack.address) as client:
            stack.worker = stack.worker.restart({"--num-blocks": "32"})
            await _eventually(lambda: _log_has(stack.scheduler.log_path, "another num_blocks"), 30)
            assert await _scheduler_statuses(channel) == NOT_SERVING
            stack.worker = stack.worker.restart({"--num-blocks": "64"})
            await _eventually(lambda: _statuses_are(channel, SERVING), 30)
            assert (await client.complete([1, 2, 3], max_tokens=4, ignore_eos=True)).token_ids


async def test_a_second_scheduler_on_a_driven_worker_stays_not_serving(tmp_path: Path) -> None:
    # The worker refuses a second Execute stream; that scheduler must not
    # flip to SERVING each time it opens one.
    with running_stack(StackConfig(num_blocks=32), tmp_path) as stack:
        port = free_port()
        log_path = tmp_path / "second-scheduler.log"
        with log_path.open("w") as log:
            second = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "scheduler_svc", "--listen", f"127.0.0.1:{port}",
                "--worker-address", stack.worker.address, stdout=asyncio.subprocess.DEVNULL,
                stderr=log)
        try:
            async with rpc_connections.insecure_channel(f"127.0.0.1:{port}") as channel:
                await _eventually(lambda: _log_has(log_path, "another scheduler is driving"), 30)
                for _ in range(20):  # several reconnects, one every second
                    assert await _scheduler_statuses(channel) == NOT_SERVING
                    await asyncio.sleep(0.1)
        finally:
            second.kill()
            await second.wait()
        async with Client(stack.address) as client:  # the first one is undisturbed
            assert (await client.complete([1, 2, 3], max_tokens=4, ignore_eos=True)).token_ids


async def _log_has(path: Path, text: str) -> bool:
    return text in await asyncio.to_thread(path.read_text)


async def _statuses_are(channel: grpc.aio.Channel, expected: set[int]) -> bool:
    return await _scheduler_statuses(channel) == expected


async def _cache_available(client: Client, expected: bool) -> bool:
    return (await client.stats()).cache_available == expected
