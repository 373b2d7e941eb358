"""Byte-identical round trips through both tiers, over a real gRPC socket."""

from __future__ import annotations

import numpy as np
import pytest
from cache_helpers import MIB, bytes_per_block, make_layout, make_payload

from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common.wire import layout_from_proto
from kvstash.v1 import cache_pb2

LAYOUTS = [
    make_layout("float16"),
    make_layout("bfloat16", num_layers=3, block_size=8, num_kv_heads=2, head_dim=128),
    make_layout("float32", num_layers=1, block_size=32, num_kv_heads=8, head_dim=64),
    make_layout("float64", num_layers=2, block_size=4, num_kv_heads=1, head_dim=96),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.dtype)
async def test_round_trip_through_memory_and_disk(start_cache, layout) -> None:
    running = await start_cache(memory_budget_bytes=8 * MIB)
    client = running.client
    num_blocks = (3 * MIB + 12345) // bytes_per_block(layout) + 1  # a short last chunk
    first = make_payload(layout, num_blocks, seed=1)
    second = make_payload(layout, num_blocks, seed=2)
    third = make_payload(layout, num_blocks, seed=3)
    for name, data in (("a", first), ("b", second), ("c", third)):
        assert await client.put(name, layout, num_blocks, 7, data) == data.nbytes

    # 8 MiB of memory holds two: the first spilled to disk when the third came.
    assert (await client.stat("a")).tier == cache_pb2.TIER_DISK
    assert (await client.stat("c")).tier == cache_pb2.TIER_MEMORY
    for name, data in (("a", first), ("b", second), ("c", third)):
        out = np.zeros_like(data)
        header = await client.get_into(name, memoryview(out))
        assert out.tobytes() == data.tobytes()
        assert layout_from_proto(header.layout) == layout and header.num_blocks == num_blocks
        assert header.num_tokens == 7 and header.total_bytes == data.nbytes
    header, got = await client.get("a")
    assert got == first.tobytes()
    running.cache.store.check_integrity()


async def test_resume_from_start_chunk_and_stat(start_cache) -> None:
    running = await start_cache()
    layout = make_layout()
    data = make_payload(layout, 100)  # 3.125 MiB -> 4 chunks of 1 MiB
    await running.client.put("resume-me", layout, 100, 1600, data, pinned=False, ttl_s=60)
    info = await running.client.stat("resume-me")
    assert info.num_chunks == 4 and not info.header.pinned and info.header.ttl_s == 60
    out = np.zeros_like(data)
    await running.client.get_into("resume-me", memoryview(out), start_chunk=2)
    assert out[2 * MIB :].tobytes() == data[2 * MIB :].tobytes()
    assert not out[: 2 * MIB].any()


async def test_delete_stat_and_unknown_ids(start_cache) -> None:
    running = await start_cache()
    client = running.client
    layout = make_layout()
    data = make_payload(layout, 40)
    await client.put("x", layout, 40, 0, data)
    with pytest.raises(errors.AlreadyExists):
        await client.put("x", layout, 40, 0, data)
    with pytest.raises(errors.InvalidArgument, match="buffer has"):
        await client.get_into("x", memoryview(bytearray(10)))
    await client.delete("x")
    for call in (client.delete("x"), client.stat("x"), client.get("x")):
        with pytest.raises(errors.NotFound):
            await call
    await running.assert_nothing_left()


async def test_stats_count_traffic(start_cache) -> None:
    running = await start_cache()
    layout = make_layout()
    data = make_payload(layout, 40)
    await running.client.put("x", layout, 40, 0, data)
    await running.client.get("x")
    stats = await running.client.stats()
    assert (stats.num_puts, stats.num_gets) == (1, 1)
    assert stats.bytes_in == stats.bytes_out == data.nbytes
    assert stats.pinned_bytes == stats.memory_bytes == data.nbytes
    assert stats.free_bytes == 32 * MIB + 64 * MIB - data.nbytes


async def test_unreachable_server_is_unavailable() -> None:
    async with CacheClient("127.0.0.1:1", timeout_s=2) as client:
        with pytest.raises(errors.Unavailable):
            await client.stats()
