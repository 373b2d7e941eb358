"""The cache's memory bound holds whatever its clients do: puts whose client
sends every chunk right after the header, without waiting for admission (as
grpcurl or a client in another language may), against a real process."""

from __future__ import annotations

import asyncio
import collections
import contextlib

import grpc
import pytest
from cache_helpers import (
    MIB,
    RssSampler,
    make_header,
    send_without_waiting,
    start_cache_process,
    wait_until,
)

from cache_svc.config import CacheConfig
from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.cache_sdk.chunk_codec import checksum, encode_chunk
from kvstash.common.layout import Layout
from kvstash.v1 import cache_pb2

BUDGET = 256 * MIB
NUM_PUTS = 32
NUM_CONNECTIONS = 4
CHUNK = 2 * MIB
# 1 MiB blocks, so that a put of 64 blocks is 64 MiB in 32 chunks of 2 MiB.
LAYOUT = Layout(num_layers=1, block_size=1, num_kv_heads=1, head_dim=MIB // 4, dtype="float16")
NUM_BLOCKS = 64
CHUNKS = NUM_BLOCKS * MIB // CHUNK


def put_messages(name: str, chunks: list[bytes], pinned: bool) -> list[bytes]:
    header = make_header(name, LAYOUT, NUM_BLOCKS, chunk_bytes=CHUNK, pinned=pinned)
    return [cache_pb2.PutSnapshotRequest(header=header).SerializeToString(), *chunks]


# Unpinned puts get in by evicting older ones: every put is admitted at last
# and sends all its bytes. Pinned ones (no disk tier) fill the budget, then
# the rest are refused and read out by the server: the refusal path.
@pytest.mark.parametrize(("pinned", "pool_args"), [(False, ()), (True, ("--buffer-pool", "0"))],
                         ids=["evicting", "refusing_without_pool"])
async def test_puts_that_do_not_wait_for_admission_stay_within_the_bound(
    processes, pinned: bool, pool_args: tuple[str, ...]
) -> None:
    # 32 puts of 64 MiB (2 GiB) against a 256 MiB budget, all at once, as in
    # the report this reproduces (peak 2.1 GiB, 1.6 GiB after 80 s idle; 584
    # MiB without the buffer pool; the documented bound allows 288 MiB over
    # idle + budget). ~2-4 s each here.
    process = start_cache_process(
        "--memory-budget", "256MiB", "--reserve-wait", "60",
        "--sweep-interval", "0.2", "--buffer-pool-idle", "1s", *pool_args,
    )
    processes.append(process)
    baseline = process.rss_bytes()
    limit = baseline + BUDGET + CacheConfig(memory_budget_bytes=BUDGET).overhead_bytes(NUM_PUTS)
    payload = bytes(range(256)) * (CHUNK // 256)
    digest = checksum(payload)
    chunks = [encode_chunk(i, payload, digest) for i in range(CHUNKS)]  # shared by all puts
    channels = [grpc.aio.insecure_channel(process.address) for _ in range(NUM_CONNECTIONS)]
    try:
        with RssSampler(process, interval_s=0.05) as rss:
            codes = await asyncio.gather(*(
                send_without_waiting(channels[i % NUM_CONNECTIONS],
                                     put_messages(f"s{i}", chunks, pinned), timeout_s=120)
                for i in range(NUM_PUTS)))
    finally:
        for channel in channels:
            await channel.close()
    peak = max(rss.peak, process.rss_bytes("VmHWM"))  # the kernel's exact high-water mark
    print(f"baseline {baseline / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB, limit "
          f"{limit / MIB:.0f} MiB, {rss.num_samples} samples, {collections.Counter(codes)}")
    assert peak <= limit, f"peak RSS {peak / MIB:.0f} MiB > {limit / MIB:.0f} MiB"
    # Every put ended with a status the protocol defines, none in a grpc
    # failure (INTERNAL, UNAVAILABLE, ...).
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    expected_ok = BUDGET // (NUM_BLOCKS * MIB) if pinned else NUM_PUTS
    assert codes.count(grpc.StatusCode.OK) == expected_ok, codes

    async with CacheClient(process.address) as client:
        stats = await client.stats()
        assert stats.num_puts == codes.count(grpc.StatusCode.OK)
        assert stats.reserved_bytes == 0 and stats.memory_bytes <= BUDGET
        for i in range(NUM_PUTS):
            with contextlib.suppress(errors.NotFound):  # evicted by a later put
                await client.delete(f"s{i}")
        assert (await client.stats()).memory_bytes == 0
    # With the snapshots gone, pooled buffers are unmapped after 1 s idle and
    # the sweeper hands freed heap back: the process returns near idle (gRPC
    # and the heap keep some: 20-50 MiB more than at start, measured; 1 GiB
    # more, 70 s after deleting, before memory was handed back).
    try:
        await wait_until(lambda: process.rss_bytes() <= baseline + 96 * MIB,
                         "resident memory returns near idle", timeout_s=20)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {process.rss_bytes() / MIB:.0f} MiB, "
                             f"{baseline / MIB:.0f} MiB at start") from None
    print(f"idle again: {process.rss_bytes() / MIB:.0f} MiB")
