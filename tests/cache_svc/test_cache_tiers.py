"""Spill and eviction order (LRU), pinning, TTL expiry (on a fake clock)."""

from __future__ import annotations

import asyncio
import os
import time
import zlib

import pytest
from cache_helpers import MIB, FakeClock, make_layout, make_payload, on_disk, wait_until

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
    running = await start_cache(memory_budget_bytes=8 * MIB, disk_budget_bytes=on_disk(2),
                                unpinned_share=1.0)
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


async def test_an_unpinned_snapshot_is_evicted_rather_than_one_used_more_recently(
        start_cache) -> None:
    """Spilling the least recently used unpinned snapshot in memory would
    evict one read since from the full disk: it is evicted itself instead."""
    running = await start_cache(memory_budget_bytes=8 * MIB, disk_budget_bytes=on_disk(1),
                                unpinned_share=1.0)
    for name in ("u1", "u2", "u3"):  # u3 spills u1 and fills the disk
        await put(running, name, pinned=False)
    await running.client.get("u1")  # LRU order now u2, u3, u1
    await put(running, "u4", pinned=False)
    absent = cache_pb2.TIER_UNSPECIFIED
    assert await running.client.find(["u1", "u2", "u3", "u4"]) == [DISK, absent, MEMORY, MEMORY]
    assert (await running.client.stats()).num_evictions == 1
    running.cache.store.check_integrity()


async def test_pinned_snapshots_survive_pressure(start_cache) -> None:
    running = await start_cache(memory_budget_bytes=8 * MIB, disk_budget_bytes=on_disk(2))
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
    assert stats.pinned_bytes == 8 * MIB + on_disk(2) and stats.num_refused == 2
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
    # A fake TTL clock and explicit sweeps: nothing here depends on how fast
    # the machine is.
    clock = FakeClock()
    running = await start_cache(clock=clock, memory_budget_bytes=4 * MIB, default_ttl_s=10,
                                sweep_interval_s=3600)
    store = running.cache.store
    await put(running, "old")  # spilled to disk by the next put
    await put(running, "kept", ttl_s=60)
    assert (await running.client.stat("old")).header.ttl_s == 10
    assert await tiers(running, "old", "kept") == [DISK, MEMORY]
    clock.advance(9)
    assert store.sweep_expired() == 0
    clock.advance(1)  # "old" has been idle for its whole TTL
    assert store.sweep_expired() == 1
    with pytest.raises(errors.NotFound):
        await running.client.stat("old")
    assert (await running.client.stat("kept")).tier == MEMORY
    stats = await running.client.stats()
    assert stats.num_expired == 1 and stats.disk_snapshots == 0
    await wait_until(lambda: running.disk_files() == [], "the expired file is removed")
    store.check_integrity()


async def test_access_postpones_expiry(start_cache) -> None:
    clock = FakeClock()
    running = await start_cache(clock=clock, default_ttl_s=10, sweep_interval_s=3600)
    store = running.cache.store
    await put(running, "busy")
    for _ in range(3):
        clock.advance(6)
        await running.client.get("busy")
        assert store.sweep_expired() == 0
    clock.advance(9)  # 27 s since the put, 9 since the last get
    assert store.sweep_expired() == 0
    clock.advance(1)
    assert store.sweep_expired() == 1
    assert (await running.client.stats()).num_expired == 1


async def test_sweeper_expires_on_its_own(start_cache) -> None:
    clock = FakeClock()
    running = await start_cache(clock=clock, default_ttl_s=10, sweep_interval_s=0.01)
    await put(running, "idle")
    clock.advance(10)

    async def expired() -> bool:
        return (await running.client.stats()).num_expired == 1

    await wait_until(expired, "the sweeper expires the idle snapshot")
    with pytest.raises(errors.NotFound):
        await running.client.stat("idle")


async def test_find_answers_where_each_snapshot_is_and_counts_as_a_use(start_cache) -> None:
    """A prefix segment an instance also holds locally is found at each
    admission and never read: it was the first to go, before segments
    nobody asked for, and expired an idle TTL after its put."""
    clock = FakeClock()
    running = await start_cache(clock=clock, memory_budget_bytes=8 * MIB,
                                disk_budget_bytes=16 * MIB, default_ttl_s=10,
                                sweep_interval_s=3600)
    await put(running, "a")
    await put(running, "b")
    await put(running, "c")  # a spills
    clock.advance(9)
    found = await running.client.find(["b", "nope", "a"])
    assert found == [MEMORY, cache_pb2.TIER_UNSPECIFIED, DISK]
    # Finding b made it more recent than c: c is the next to spill.
    await put(running, "d")
    assert await tiers(running, "b", "c", "d") == [MEMORY, DISK, MEMORY]
    clock.advance(1)  # c idle for its TTL; a and b found 1 s ago
    assert running.cache.store.sweep_expired() == 1
    assert await tiers(running, "a", "b", "d") == [DISK, MEMORY, MEMORY]


async def test_find_leaves_the_first_of_the_ids_it_finds_the_most_recent(start_cache) -> None:
    """A prompt's segments are asked for in order, and a later one is of no
    use without those before it: the later ones go (spill) first."""
    running = await start_cache(memory_budget_bytes=8 * MIB, disk_budget_bytes=16 * MIB)
    await put(running, "s0")
    await put(running, "s1")
    assert await running.client.find(["s0", "s1"]) == [MEMORY, MEMORY]
    await put(running, "other")
    assert await tiers(running, "s0", "s1", "other") == [MEMORY, DISK, MEMORY]


async def test_a_snapshot_found_on_disk_is_still_recent_after_a_restart(start_cache) -> None:
    """A restart orders the disk tier by its files' mtimes (and starts TTLs
    from them): a disk snapshot only ever found, never read, kept the mtime of
    its spill, and was then the first to go."""
    one_mib = 32  # blocks of LAYOUT
    running = await start_cache(memory_budget_bytes=4 * MIB, unpinned_share=1.0)
    for i in range(8):  # u0..u3 spill to disk, oldest first; u4..u7 stay in memory
        await running.client.put(f"u{i}", LAYOUT, one_mib, 0,
                                 make_payload(LAYOUT, one_mib, seed=i), pinned=False)
    # Spilled a minute apart, as in service: here they and the find's touch
    # may fall within one tick of a file system's coarse timestamps (4 ms on
    # many kernels), and an mtime tie lets the restart keep any two of them.
    spilled = time.time() - 600
    for i in range(4):
        [path] = running.disk_dir.glob(f"u{i}~*")
        os.utime(path, (spilled + 60 * i, spilled + 60 * i))
    assert await running.client.find(["u0"]) == [DISK]
    stats = await running.client.stats()
    assert stats.disk_snapshots == 4
    charge = stats.disk_bytes // 4
    await running.cache.stop(0)

    running = await start_cache(memory_budget_bytes=4 * MIB, disk_budget_bytes=2 * charge,
                                unpinned_share=1.0)
    assert await tiers(running, "u0", "u3") == [DISK, DISK]  # found, and the newest file
    for name in ("u1", "u2"):  # the oldest went
        with pytest.raises(errors.NotFound):
            await running.client.stat(name)


@pytest.mark.parametrize("ids", [[], ["ok", "../etc"], ["x"] * 4097])
async def test_find_refuses_bad_ids_and_too_many(start_cache, ids: list[str]) -> None:
    running = await start_cache()
    with pytest.raises(errors.InvalidArgument):
        await running.client.find(ids)


@pytest.mark.parametrize("disk", [0, 16 * MIB])
async def test_an_unpinned_put_never_displaces_a_pinned_snapshot(start_cache, disk: int) -> None:
    running = await start_cache(memory_budget_bytes=8 * MIB, disk_budget_bytes=disk,
                                reserve_wait_s=0.2, **({} if disk else {"disk_dir": None}))
    await put(running, "p1")
    await put(running, "p2")
    with pytest.raises(errors.ResourceExhausted, match="displacing no pinned"):
        await put(running, "segment", pinned=False)
    assert await tiers(running, "p1", "p2") == [MEMORY, MEMORY]
    assert (await running.client.stats()).num_refused == 1
    running.cache.store.check_integrity()


async def test_unpinned_snapshots_stay_within_their_share(start_cache) -> None:
    running = await start_cache(memory_budget_bytes=16 * MIB, disk_budget_bytes=on_disk(1),
                                unpinned_share=0.5)

    async def settle(expected: list[int]) -> None:
        """Until the tiers are `expected` (a spill ends after the put it made
        room for). Read with stat: a find counts as a use, reordering the LRU
        this test is about."""
        async def done() -> bool:
            found = []
            for name in ("u1", "u2", "u3", "u4"):
                try:
                    found.append((await running.client.stat(name)).tier)
                except errors.NotFound:
                    found.append(absent)
            return found == expected

        await wait_until(done, f"tiers {expected}")

    absent = cache_pb2.TIER_UNSPECIFIED
    await put(running, "u1", pinned=False)
    await put(running, "u2", pinned=False)
    await put(running, "u3", pinned=False)  # over 8 MiB: u1 moves out, to disk
    await settle([DISK, MEMORY, MEMORY, absent])
    await put(running, "u4", pinned=False)  # the disk is full: u1 evicted, u2 spilled
    await settle([absent, DISK, MEMORY, MEMORY])
    await put(running, "p1")  # pinned ones use the rest of the budget
    await put(running, "p2")
    assert await tiers(running, "p1", "p2", "u3", "u4") == [MEMORY] * 4
    running.cache.store.check_integrity()


async def test_an_unpinned_put_beyond_its_share_is_refused_at_once(start_cache) -> None:
    """It could never fit, so it does not wait out reserve_wait_s while a get
    (or anything else) is running."""
    running = await start_cache(memory_budget_bytes=8 * MIB, unpinned_share=0.25,
                                reserve_wait_s=10.0)
    await put(running, "a")
    store = running.cache.store
    reader = await store.reads.open_reader("a")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(errors.ResourceExhausted, match=r"share of the memory budget, 0\.25"):
        await put(running, "segment", pinned=False)  # 4 MiB, of 8 MiB (4 free)
    assert loop.time() - started < 5
    store.reads.close_reader(reader)
    assert (await running.client.stats()).num_refused == 1
    store.check_integrity()
