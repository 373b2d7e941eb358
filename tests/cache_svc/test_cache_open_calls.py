"""Calls held open: a get the client cancels mid-stream gives back what it
held at once, not whenever the garbage collector runs (GetSnapshot is an
async generator, and its `finally` closes the reader and releases its
in-flight share when grpc drops it: within 10 ms, measured); and calls
beyond `max_concurrent_rpcs` are refused."""

from __future__ import annotations

import gc

import grpc
import pytest
from cache_helpers import MIB, wait_until

from kvstash.common.layout import Layout
from kvstash.v1 import cache_pb2

LAYOUT = Layout(num_layers=1, block_size=1, num_kv_heads=1, head_dim=MIB // 4, dtype="float16")


async def test_cancelled_get_releases_its_reader_and_share(start_cache) -> None:
    running = await start_cache(bandwidth_limit_bytes_per_s=4 * MIB)
    await running.client.put("snap", LAYOUT, 8, 8, bytes(8 * MIB))
    call = running.stub.GetSnapshot(cache_pb2.GetSnapshotRequest(snapshot_id="snap"))
    await call.read()  # the header
    await call.read()  # chunk 0; the server is pacing the next ones
    call.cancel()
    store = running.cache.store
    gc.disable()  # what runs at once must not depend on a collection
    assert any(e.num_readers for e in store._tiers.entries())
    try:
        await wait_until(lambda: not any(e.num_readers for e in store._tiers.entries()),
                         "the reader is closed", timeout_s=3)
    finally:
        gc.enable()
    store.check_integrity()


async def test_calls_beyond_the_cap_are_resource_exhausted(start_cache) -> None:
    # Two slow gets fill a cap of two: a third call is refused at once (each
    # open stream may hold a receive window, so their number is bounded).
    running = await start_cache(bandwidth_limit_bytes_per_s=2 * MIB, max_concurrent_rpcs=2)
    await running.client.put("snap", LAYOUT, 4, 4, bytes(4 * MIB))
    calls = [running.stub.GetSnapshot(cache_pb2.GetSnapshotRequest(snapshot_id="snap"))
             for _ in range(2)]
    for call in calls:
        await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await running.stub.StatSnapshot(cache_pb2.StatSnapshotRequest(snapshot_id="snap"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in calls:
        call.cancel()
    await wait_until(lambda: not any(e.num_readers for e in running.cache.store._tiers.entries()),
                     "the gets ended")
    assert (await running.client.stat("snap")).num_chunks == 4
