"""Backpressure: a slow reader paces the server, a slow disk paces writers,
and many concurrent streams stay within the accounting budget."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from cache_helpers import MIB, make_layout, make_payload, wait_until

from cache_svc.config import MAX_STREAMS_PER_CONNECTION
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.v1 import cache_pb2

LAYOUT = make_layout()  # 32 KiB blocks


async def test_slow_reader_paces_the_server(start_cache) -> None:
    running = await start_cache(memory_budget_bytes=64 * MIB)
    data = make_payload(LAYOUT, 1536)  # 48 MiB, 48 chunks of 1 MiB
    await running.client.put("big", LAYOUT, 1536, 0, data)
    call = running.stub.GetSnapshot(cache_pb2.GetSnapshotRequest(snapshot_id="big"))
    received = bytearray()
    async for response in call:
        if response.HasField("chunk"):
            received += response.chunk.data
            if len(received) == 2 * MIB:
                break
    await asyncio.sleep(1.0)  # the reader stalls; the server must not run ahead
    sent = (await running.client.stats()).bytes_out
    assert sent < 16 * MIB, f"server produced {sent / MIB:.0f} MiB for a stalled reader"
    async for response in call:
        received += response.chunk.data
    assert bytes(received) == data.tobytes()


async def test_a_reader_that_stops_reading_is_let_go(start_cache) -> None:
    # No disk: the new put fits only once "big" is evicted, which its reader
    # prevents while it holds it.
    running = await start_cache(memory_budget_bytes=64 * MIB, disk_dir=None,
                                disk_budget_bytes=0, get_idle_s=0.5, reserve_wait_s=3.0,
                                unpinned_share=1.0)
    data = make_payload(LAYOUT, 1536)  # 48 MiB
    await running.client.put("big", LAYOUT, 1536, 0, data, pinned=False)
    call = running.stub.GetSnapshot(cache_pb2.GetSnapshotRequest(snapshot_id="big"))
    async for response in call:
        if response.HasField("chunk"):
            break  # and read no more, without cancelling
    other = make_payload(LAYOUT, 1024, seed=1)  # 32 MiB
    await running.client.put("other", LAYOUT, 1024, 0, other, pinned=False, timeout_s=20)
    assert (await running.client.stats()).num_evictions == 1  # big, let go by its reader
    with pytest.raises(grpc.aio.AioRpcError) as info:  # reading again, it learns why
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "took no message for 0.5 s" in (info.value.details() or "")
    running.cache.store.check_integrity()


async def test_slow_disk_makes_writers_wait(start_cache) -> None:
    # 8 MiB of memory and a 20 MiB/s disk: every put beyond the second waits
    # for a 4 MiB spill (~0.2 s); memory accounting never exceeds the budget.
    running = await start_cache(memory_budget_bytes=8 * MIB, disk_budget_bytes=64 * MIB,
                                disk_write_bytes_per_s=20 * MIB, reserve_wait_s=10)
    store = running.cache.store
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            stats = store.stats()
            peak = max(peak, stats.memory_bytes + stats.reserved_bytes)
            store.check_integrity()
            await asyncio.sleep(0.005)

    watcher = asyncio.ensure_future(watch())
    payloads = [make_payload(LAYOUT, 128, seed=i) for i in range(6)]
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.gather(*(running.client.put(f"s{i}", LAYOUT, 128, 0, p)
                           for i, p in enumerate(payloads)))
    elapsed = loop.time() - started
    watcher.cancel()
    assert elapsed > 0.6, (
        f"6 puts took {elapsed:.2f} s; spills of 16 MiB at 20 MiB/s did not pace them"
    )
    assert peak <= 8 * MIB
    for i, p in enumerate(payloads):
        assert (await running.client.get(f"s{i}"))[1] == p.tobytes()
    assert (await running.client.stats()).num_spills >= 4


async def test_a_put_waits_for_the_memory_a_deleted_snapshots_reader_holds(start_cache) -> None:
    """That memory is freed when the reader closes: the put waits for it, as
    for a spill, rather than being refused at once."""
    running = await start_cache(memory_budget_bytes=8 * MIB, disk_dir=None,
                                disk_budget_bytes=0, reserve_wait_s=10)
    payloads = [make_payload(LAYOUT, 128, seed=i) for i in range(3)]  # 4 MiB each
    for name, payload in zip("ab", payloads, strict=False):
        await running.client.put(name, LAYOUT, 128, 0, payload)
    store = running.cache.store
    reader = await store.reads.open_reader("a")
    await running.client.delete("a")  # unlisted; its buffer stays for the reader
    putting = asyncio.ensure_future(running.client.put("c", LAYOUT, 128, 0, payloads[2]))
    await wait_until(lambda: "c" in store._pending or putting.done(), "the put reaches the cache")
    await asyncio.sleep(0.1)
    assert not putting.done()
    store.reads.close_reader(reader, finished=True)
    await putting
    assert (await running.client.get("c"))[1] == payloads[2].tobytes()
    store.check_integrity()


async def test_concurrent_puts_and_gets_in_process(start_cache) -> None:
    running = await start_cache(memory_budget_bytes=24 * MIB, disk_budget_bytes=128 * MIB,
                                max_inflight_bytes=12 * MIB, reserve_wait_s=20)
    address = running.client.address
    payloads = [make_payload(LAYOUT, 64 + i, seed=i) for i in range(16)]
    async with CacheClient(address, chunk_bytes=MIB) as a, CacheClient(address) as b:
        clients = [a, b]
        await asyncio.gather(*(clients[i % 2].put(f"c{i}", LAYOUT, 64 + i, 0, p)
                               for i, p in enumerate(payloads)))
        outs = [np.zeros_like(p) for p in payloads]
        await asyncio.gather(*(clients[i % 2].get_into(f"c{i}", memoryview(o))
                               for i, o in enumerate(outs)))
    for p, o in zip(payloads, outs, strict=True):
        assert o.tobytes() == p.tobytes()
    stats = await running.client.stats()
    assert stats.memory_bytes <= 24 * MIB and stats.reserved_bytes == 0
    running.cache.store.check_integrity()


@pytest.mark.parametrize("path", ["streamed", "arena"])
async def test_more_calls_than_a_connections_stream_limit_are_not_refused(
    start_cache, tmp_path, path
) -> None:
    # Twice MAX_STREAMS_PER_CONNECTION calls at once on one channel, round
    # after round: the client waits for streams beyond the limit, but counts
    # an ended one as gone before the server does, and the server then
    # refuses the next with REFUSED_STREAM (a few times a round, measured).
    # A refused call never ran, so the client makes it again.
    arena_dir = tmp_path / "arena" if path == "arena" else None
    running = await start_cache(arena_dir=arena_dir, max_concurrent_rpcs=1024)
    client = running.client
    assert (await client.arena() is not None) == (path == "arena")
    data = make_payload(LAYOUT, 4)  # 128 KiB
    num_calls = 2 * MAX_STREAMS_PER_CONNECTION

    async def put_get_delete(name: str) -> None:
        await client.put(name, LAYOUT, 4, 0, data)
        out = np.zeros_like(data)
        await client.get_into(name, memoryview(out))
        assert out.tobytes() == data.tobytes()
        await client.delete(name)

    for round_ in range(8):
        await asyncio.gather(*(put_get_delete(f"r{round_}-{i}") for i in range(num_calls)))
    await running.assert_nothing_left()
