"""A greedy workload that overflows a small KV pool, and its checks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.client import Client, GenerateResult
from kvstash.common.security import PLAINTEXT, Security
from kvstash.v1 import cache_pb2, scheduler_pb2
from tests.integration.reference import reference_greedy

NUM_REQUESTS = 24
MAX_TOKENS = 96
# 24 requests of up to 155 tokens want ~170 blocks of 16; 16 blocks fit one or
# two at a time. An optimistic initial new_token_ratio admits more than fit, so
# decode requests get preempted over and over (about 30 times per run).
PRESSURED_BLOCKS = 16
PRESSURED_SCHEDULER_ARGS = ("--init-new-token-ratio", "0.05")


def prompts() -> list[list[int]]:
    return [[(i * 31 + j * 7 + 3) % 256 for j in range(10 + (i * 13) % 50)]
            for i in range(NUM_REQUESTS)]


def expected_outputs() -> list[list[int]]:
    return [reference_greedy(p, MAX_TOKENS) for p in prompts()]


@dataclass(slots=True)
class Outcome:
    results: list[GenerateResult]
    stats: scheduler_pb2.SchedulerStats


async def run_workload(address: str, security: Security = PLAINTEXT) -> Outcome:
    async with Client(address, security) as client:
        results = await asyncio.gather(*[
            client.complete(p, max_tokens=MAX_TOKENS, ignore_eos=True) for p in prompts()])
        return Outcome(list(results), await client.stats())


async def cache_stats(address: str, security: Security = PLAINTEXT) -> cache_pb2.CacheStats:
    async with CacheClient(address, security=security) as cache:
        return await cache.stats()


async def wait_drained(address: str, timeout_s: float = 10.0) -> scheduler_pb2.SchedulerStats:
    """Stats once every block is back (snapshot deletions are asynchronous)."""
    async with Client(address) as client:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            stats = await client.stats()
            drained = stats.num_free_blocks + stats.num_evictable_blocks == stats.num_total_blocks
            if drained or asyncio.get_running_loop().time() > deadline:
                return stats
            await asyncio.sleep(0.05)
