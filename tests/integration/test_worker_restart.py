"""A worker that dies takes its KV with it: requests in flight fail with
UNAVAILABLE (never hang), and once a new worker is up the scheduler serves
again with correct outputs — no stale cached prefix is trusted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvstash import errors
from kvstash.client import Client
from kvstash.common import rpc_connections
from kvstash.launch.stack import StackConfig, running_stack
from kvstash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.reference import reference_greedy

# Three full 16-token blocks: a second run of it hits the prefix cache.
PROMPT = [(j * 29 + 11) % 256 for j in range(50)]


async def complete_when_back(client: Client, timeout_s: float = 60) -> list[int]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return (await client.complete(PROMPT, max_tokens=16, ignore_eos=True)).token_ids
        except errors.Unavailable:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_worker_restart_fails_in_flight_then_serves_correctly(tmp_path: Path) -> None:
    expected = reference_greedy(PROMPT, 16)
    with running_stack(StackConfig(num_blocks=64), tmp_path) as stack:
        async with Client(stack.address) as client:
            assert (await client.complete(PROMPT, max_tokens=16, ignore_eos=True)).token_ids \
                == expected
            assert (await client.stats()).num_evictable_blocks >= 3  # the prompt is cached

            # Killed mid-generation: the stream ends with the UNAVAILABLE status
            # (raw gRPC here, as grpcurl or another language's client sees it).
            async with rpc_connections.insecure_channel(stack.address) as channel:
                call = scheduler_pb2_grpc.SchedulerStub(channel).Generate(
                    scheduler_pb2.GenerateRequest(
                        token_ids=scheduler_pb2.TokenIds(ids=[7, 8, 9]),
                        sampling=common_pb2.SamplingParams(max_tokens=1000, ignore_eos=True)))
                assert (await call.read()).token_ids
                stack.worker.kill()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    while await call.read() is not grpc.aio.EOF:
                        pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker" in (info.value.details() or "")

            stack.worker = stack.worker.restart()
            assert await complete_when_back(client) == expected
            stats = await client.stats()
    assert stats.num_running_decode == stats.num_waiting == 0


async def test_worker_restart_while_idle_is_noticed(tmp_path: Path) -> None:
    expected = reference_greedy(PROMPT, 16)
    with running_stack(StackConfig(num_blocks=64), tmp_path) as stack:
        async with Client(stack.address) as client:
            assert (await client.complete(PROMPT, max_tokens=16, ignore_eos=True)).token_ids \
                == expected
            stack.worker = stack.worker.restart()  # nothing in flight
            assert await complete_when_back(client) == expected
            # And it keeps serving after that.
            assert (await client.complete(PROMPT, max_tokens=16, ignore_eos=True)).token_ids \
                == expected
