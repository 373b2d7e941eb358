"""Gets with `consume`: the snapshot is deleted once its last chunk has been
sent, from either tier, and only then; other reads of it finish unharmed."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from cache_helpers import MIB, make_layout, make_payload, wait_until

from kvstash import errors
from kvstash.v1 import cache_pb2

LAYOUT = make_layout()  # 32 KiB blocks
NUM_BLOCKS = 128  # 4 MiB: four chunks of 1 MiB


def readers_closed(running) -> bool:
    return not any(e.num_readers for e in running.cache.store._tiers.entries())


async def read_chunks(call) -> bytes:
    """The payload of the chunks left on a GetSnapshot call read with read()."""
    received = bytearray()
    while (response := await call.read()) is not grpc.aio.EOF:
        received += response.chunk.data
    return bytes(received)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned"])
async def test_consuming_get_deletes_and_frees(start_cache, pinned: bool) -> None:
    running = await start_cache()
    client = running.client
    data = make_payload(LAYOUT, NUM_BLOCKS)
    await client.put("once", LAYOUT, NUM_BLOCKS, 0, data, pinned=pinned)
    before = await client.stats()
    out = np.zeros_like(data)
    header = await client.get_into("once", memoryview(out), consume=True)
    assert out.tobytes() == data.tobytes() and header.total_bytes == data.nbytes
    with pytest.raises(errors.NotFound):
        await client.stat("once")
    stats = await client.stats()
    assert (stats.num_gets, stats.num_consumed, stats.num_expired, stats.num_evictions) == (
        1, 1, 0, 0)
    assert stats.memory_snapshots == stats.memory_bytes == stats.pinned_bytes == 0
    assert stats.free_bytes == before.free_bytes + data.nbytes
    with pytest.raises(errors.NotFound):
        await client.get("once", consume=True)
    await running.assert_nothing_left()


async def test_plain_get_keeps_the_snapshot(start_cache) -> None:
    running = await start_cache()
    data = make_payload(LAYOUT, NUM_BLOCKS)
    await running.client.put("kept", LAYOUT, NUM_BLOCKS, 0, data)
    for _ in range(2):
        _, got = await running.client.get("kept")
        assert got == data.tobytes()
    stats = await running.client.stats()
    assert (stats.num_gets, stats.num_consumed, stats.memory_bytes) == (2, 0, data.nbytes)


async def test_consuming_get_cancelled_midway_keeps_the_snapshot(start_cache) -> None:
    running = await start_cache(bandwidth_limit_bytes_per_s=4 * MIB)  # ~0.25 s a chunk
    data = make_payload(LAYOUT, NUM_BLOCKS)
    await running.client.put("half", LAYOUT, NUM_BLOCKS, 0, data)
    call = running.stub.GetSnapshot(
        cache_pb2.GetSnapshotRequest(snapshot_id="half", consume=True))
    await call.read()  # the header
    await call.read()  # chunk 0; the others are still to come
    call.cancel()
    await wait_until(lambda: readers_closed(running), "the cancelled get is closed")
    assert (await running.client.stat("half")).num_chunks == 4
    _, got = await running.client.get("half")
    assert got == data.tobytes()
    assert (await running.client.stats()).num_consumed == 0
    running.cache.store.check_integrity()


async def test_consuming_get_from_the_disk_tier(start_cache) -> None:
    running = await start_cache(memory_budget_bytes=8 * MIB)
    client = running.client
    payloads = {name: make_payload(LAYOUT, NUM_BLOCKS, seed=i)
                for i, name in enumerate(("a", "b", "c"))}
    for name, data in payloads.items():
        await client.put(name, LAYOUT, NUM_BLOCKS, 0, data)
    assert (await client.stat("a")).tier == cache_pb2.TIER_DISK  # spilled for "c"
    _, got = await client.get("a", consume=True)
    assert got == payloads["a"].tobytes()
    with pytest.raises(errors.NotFound):
        await client.stat("a")
    await wait_until(lambda: not any(f.startswith("a~") for f in running.disk_files()),
                     "the consumed snapshot's file is removed")
    stats = await client.stats()
    assert (stats.disk_snapshots, stats.disk_bytes, stats.num_consumed) == (0, 0, 1)
    running.cache.store.check_integrity()


@pytest.mark.parametrize("tier", ["memory", "disk"])
async def test_other_reads_finish_after_a_consuming_get(start_cache, tier: str) -> None:
    running = await start_cache(memory_budget_bytes=8 * MIB)
    client = running.client
    data = make_payload(LAYOUT, NUM_BLOCKS)
    await client.put("shared", LAYOUT, NUM_BLOCKS, 0, data)
    if tier == "disk":  # two more puts spill the first one
        for name in ("x", "y"):
            await client.put(name, LAYOUT, NUM_BLOCKS, 0, make_payload(LAYOUT, NUM_BLOCKS))
        assert (await client.stat("shared")).tier == cache_pb2.TIER_DISK
    # A plain get holds the snapshot open while a consuming one reads it all.
    slow = running.stub.GetSnapshot(cache_pb2.GetSnapshotRequest(snapshot_id="shared"))
    received = bytearray()
    await slow.read()  # the header
    received += (await slow.read()).chunk.data
    _, got = await client.get("shared", consume=True)
    assert got == data.tobytes()
    with pytest.raises(errors.NotFound):
        await client.stat("shared")
    received += await read_chunks(slow)
    assert bytes(received) == data.tobytes()
    await wait_until(lambda: readers_closed(running), "both gets are closed")
    stats = await client.stats()
    assert stats.num_consumed == 1
    assert stats.memory_bytes + stats.disk_bytes == (0 if tier == "memory" else 2 * data.nbytes)
    running.cache.store.check_integrity()


async def test_consuming_get_spares_a_new_snapshot_of_the_same_id(start_cache) -> None:
    running = await start_cache(bandwidth_limit_bytes_per_s=8 * MIB)
    client = running.client
    old, new = make_payload(LAYOUT, NUM_BLOCKS, seed=1), make_payload(LAYOUT, NUM_BLOCKS, seed=2)
    await client.put("reused", LAYOUT, NUM_BLOCKS, 0, old)
    call = running.stub.GetSnapshot(
        cache_pb2.GetSnapshotRequest(snapshot_id="reused", consume=True))
    received = bytearray()
    await call.read()  # the header
    received += (await call.read()).chunk.data
    await client.delete("reused")  # and put again while the old one is still being read
    await client.put("reused", LAYOUT, NUM_BLOCKS, 0, new)
    received += await read_chunks(call)
    assert bytes(received) == old.tobytes()
    _, got = await client.get("reused")  # the old read consumed only the old snapshot
    assert got == new.tobytes()
    assert (await client.stats()).num_consumed == 0
