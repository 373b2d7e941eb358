"""Spill and eviction order (LRU), pinning, TTL expiry."""

from __future__ import annotations

import asyncio
import zlib

import pytest
from cache_helpers import MIB, make_layout, make_payload

from kvstash import errors
from kvstash.v1 import cache_pb2

LAYOUT = make_layout()
NUM_BLOCKS = 128  # 4 MiB
DISK, MEMORY = cache_pb2.TIER_DISK, cache_pb2.TIER_MEMORY


async def put(running, name: str, pinned: bool = True, ttl_s: int = 0) -> bytes:
    data = make_payload(LAYOUT, NUM_BLOCKS, seed=zlib.crc32(name.encode()))
    await running.client.put(name, LAYOUT, NUM_BLOCKS, 0, data, pinned=pinned, ttl_s=ttl_s)
    return data.tobytes()


async def tiers(running, *names: str) -> list[int]:
    return [(await running.client.stat(name)).tier for name in names]


async def test_least_recently_used_spills_first(start_cache) -> None:
    running = await start_cache(memory_budget_bytes=8 * MIB, disk_budget_bytes=16 * MIB)
    await put(running, "a")
    await put(running, "b")
    await running.client.get("a")  # now b is the least recently used
    await put(running, "c")
    assert await tiers(running, "a", "b", "c") == [MEMORY, DISK, MEMORY]
    await put(running, "d")
    assert await tiers(running, "a", "b", "c", "d") == [DISK, DISK, MEMORY, MEMORY]
    stats = await running.client.stats()
    assert (stats.num_spills, stats.num_evictions) == (2, 0)
    assert len(running.disk_files()) == 2
    running.cache.store.check_integrity()


async def test_unpinned_evicted_lru_when_both_tiers_full(start_cache) -> None:
    running = await start_cache(memory_budget_bytes=8 * MIB, disk_budget_bytes=8 * MIB)
    payloads = {name: await put(running, name, pinned=False) for name in "abcd"}
    assert await tiers(running, "a", "b", "c", "d") == [DISK, DISK, MEMORY, MEMORY]
    await running.client.get("a")  # LRU order now b, c, d, a
    payloads["e"] = await put(running, "e", pinned=False)
    with pytest.raises(errors.NotFound):
        await running.client.stat("b")
    assert await tiers(running, "a", "c", "d", "e") == [DISK, DISK, MEMORY, MEMORY]
    for name in "acde":
        assert (await running.client.get(name))[1] == payloads[name]
    stats = await running.client.stats()
    assert stats.num_evictions == 1 and len(running.disk_files()) == 2


async def test_pinned_snapshots_survive_pressure(start_cache) -> None:
    running = await start_cache(memory_budget_bytes=8 * MIB, disk_budget_bytes=8 * MIB)
    payloads = {"u1": await put(running, "u1", pinned=False)}
    for name in ("p1", "p2", "p3", "p4"):
        payloads[name] = await put(running, name)
    # u1 made room for p2 on disk; now every byte is pinned.
    with pytest.raises(errors.NotFound):
        await running.client.stat("u1")
    with pytest.raises(errors.ResourceExhausted, match="need 4194304 bytes"):
        await put(running, "p5")
    with pytest.raises(errors.ResourceExhausted):
        await put(running, "u2", pinned=False)
    assert await tiers(running, "p1", "p2", "p3", "p4") == [DISK, DISK, MEMORY, MEMORY]
    for name in ("p1", "p2", "p3", "p4"):
        assert (await running.client.get(name))[1] == payloads[name]
    stats = await running.client.stats()
    assert stats.pinned_bytes == 16 * MIB and stats.num_refused == 2
    assert stats.num_evictions == 1 and stats.free_bytes == 0
    assert stats.reserved_bytes == 0


async def test_without_disk_pinned_are_refused_unpinned_evicted(start_cache) -> None:
    running = await start_cache(memory_budget_bytes=8 * MIB, disk_dir=None, disk_budget_bytes=0)
    await put(running, "u", pinned=False)
    await put(running, "p")
    await put(running, "q")  # evicts u, the only unpinned one
    with pytest.raises(errors.NotFound):
        await running.client.stat("u")
    with pytest.raises(errors.ResourceExhausted):
        await put(running, "r")
    with pytest.raises(errors.ResourceExhausted, match="more than the memory budget"):
        await running.client.put("huge", LAYOUT, 3 * NUM_BLOCKS, 0, bytes(12 * MIB))


async def test_idle_snapshots_expire_in_both_tiers(start_cache) -> None:
    running = await start_cache(memory_budget_bytes=4 * MIB, default_ttl_s=1,
                                sweep_interval_s=0.1)
    await put(running, "old")  # spilled to disk by the next put
    await put(running, "kept", ttl_s=60)
    assert (await running.client.stat("old")).header.ttl_s == 1
    assert await tiers(running, "old", "kept") == [DISK, MEMORY]
    await asyncio.sleep(1.5)
    with pytest.raises(errors.NotFound):
        await running.client.stat("old")
    assert (await running.client.stat("kept")).tier == MEMORY
    stats = await running.client.stats()
    assert stats.num_expired == 1 and stats.disk_snapshots == 0
    assert running.disk_files() == []


async def test_access_postpones_expiry(start_cache) -> None:
    running = await start_cache(default_ttl_s=1, sweep_interval_s=0.1)
    await put(running, "busy")
    for _ in range(3):
        await asyncio.sleep(0.6)
        await running.client.get("busy")
    assert (await running.client.stats()).num_expired == 0
