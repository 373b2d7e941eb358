"""Freed snapshot buffers reused by later puts: reuse happens, never serves old
bytes, stays within the memory budget, and yields to puts that need room."""

from __future__ import annotations

import asyncio
import mmap
import threading

import grpc
import numpy as np
import pytest
from cache_helpers import (
    MIB,
    FakeClock,
    chunk_msg,
    make_header,
    make_layout,
    make_payload,
    send,
    split,
    wait_until,
)

from cache_svc import memory_tier
from cache_svc.buffers import BufferPool, close_now
from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.v1 import cache_pb2

LAYOUT = make_layout()  # 32 KiB blocks
NUM_BLOCKS = 128  # 4 MiB


async def put(running, name: str, num_blocks: int = NUM_BLOCKS, seed: int = 0,
              pinned: bool = True) -> np.ndarray:
    data = make_payload(LAYOUT, num_blocks, seed=seed)
    await running.client.put(name, LAYOUT, num_blocks, 0, data, pinned=pinned)
    return data


async def test_freed_buffer_is_reused_by_a_put_of_the_same_size(start_cache) -> None:
    running = await start_cache()
    pool = running.cache.store.buffer_pool
    await put(running, "a", seed=1)
    await running.client.delete("a")
    assert pool.num_bytes == 4 * MIB and pool.num_reused == 0
    # Another chunk size, same total: the whole buffer is overwritten all the same.
    async with CacheClient(running.client.address, chunk_bytes=4 * MIB) as client:
        data = make_payload(LAYOUT, NUM_BLOCKS, seed=2)
        await client.put("b", LAYOUT, NUM_BLOCKS, 0, data)
        assert pool.num_reused == 1 and pool.num_bytes == 0
        assert (await client.get("b"))[1] == data.tobytes()
    other = await put(running, "c", num_blocks=NUM_BLOCKS // 2, seed=3)  # another size: fresh
    assert pool.num_reused == 1
    assert (await running.client.get("c"))[1] == other.tobytes()
    stats = await running.client.stats()
    assert stats.free_bytes == 32 * MIB + 64 * MIB - 6 * MIB
    running.cache.store.check_integrity()


@pytest.mark.parametrize("failure", ["cut_off_before_last_chunk", "bad_checksum_in_middle"])
async def test_failed_put_into_reused_buffer_leaves_nothing_visible(start_cache,
                                                                    failure) -> None:
    running = await start_cache()
    store = running.cache.store
    old = await put(running, "old", seed=1)
    await running.client.delete("old")
    new = make_payload(LAYOUT, NUM_BLOCKS, seed=2).tobytes()
    pieces = split(new, MIB)
    header = cache_pb2.PutSnapshotRequest(header=make_header("new", LAYOUT, NUM_BLOCKS))
    if failure == "cut_off_before_last_chunk":  # the buffer's tail still holds `old`
        messages = [header, *(chunk_msg(i, p) for i, p in enumerate(pieces[:-1]))]
    else:
        messages = [header, chunk_msg(0, pieces[0]), chunk_msg(1, pieces[1], checksum=1),
                    *(chunk_msg(i, p) for i, p in enumerate(pieces) if i > 1)]
    error = await send(running.stub, messages)
    assert error is not None and error.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                                  grpc.StatusCode.DATA_LOSS)
    assert store.buffer_pool.num_reused == 1
    with pytest.raises(errors.NotFound):
        await running.client.stat("new")
    await running.assert_nothing_left()
    assert store.buffer_pool.num_bytes == 4 * MIB  # given back for the next put
    # The next put reuses the half-written buffer and serves only its own bytes.
    await running.client.put("new", LAYOUT, NUM_BLOCKS, 0, np.frombuffer(new, np.uint8))
    assert store.buffer_pool.num_reused == 2
    got = (await running.client.get("new"))[1]
    assert got == new and got != old.tobytes()


async def test_pooled_buffers_yield_instead_of_spilling(start_cache) -> None:
    running = await start_cache(memory_budget_bytes=8 * MIB)
    store = running.cache.store
    pinned = await put(running, "pinned", seed=1)
    await put(running, "small", num_blocks=NUM_BLOCKS // 2, seed=2)  # 2 MiB
    await running.client.delete("small")
    assert store.buffer_pool.num_bytes == 2 * MIB  # memory: 4 used, 2 pooled, 2 free
    assert (await running.client.stats()).free_bytes == 4 * MIB + 64 * MIB
    # 4 MiB of another size fit only if the pooled 2 MiB go: they do, and
    # nothing is spilled or refused for their sake.
    await put(running, "other", seed=3)
    stats = await running.client.stats()
    assert (stats.num_spills, stats.num_evictions, stats.num_refused) == (0, 0, 0)
    assert store.buffer_pool.num_bytes == 0 and store.buffer_pool.num_released == 1
    assert (await running.client.stat("pinned")).tier == cache_pb2.TIER_MEMORY
    assert (await running.client.get("pinned"))[1] == pinned.tobytes()
    store.check_integrity()


async def test_pool_is_bounded_and_trimmed_when_idle(start_cache) -> None:
    clock = FakeClock()
    running = await start_cache(clock=clock, buffer_pool_bytes=6 * MIB,
                                buffer_pool_idle_s=30.0)
    store = running.cache.store
    for name in "abc":
        await put(running, name)
    for name in "abc":
        await running.client.delete(name)
        store.check_integrity()
    assert store.buffer_pool.num_bytes == 4 * MIB  # one 4 MiB buffer fits in 6 MiB
    clock.advance(29)
    store.trim_buffer_pool()
    assert store.buffer_pool.num_bytes == 4 * MIB
    clock.advance(2)
    store.trim_buffer_pool()
    assert store.buffer_pool.num_bytes == 0
    await running.assert_nothing_left()


async def test_pool_off_never_pools(start_cache) -> None:
    running = await start_cache(buffer_pool_bytes=0)
    await put(running, "a")
    await running.client.delete("a")
    await put(running, "b")
    pool = running.cache.store.buffer_pool
    assert (pool.num_bytes, pool.num_reused) == (0, 0)


def test_buffer_pool_takes_exact_sizes_and_releases_oldest_first() -> None:
    pool = BufferPool(max_bytes=3 * MIB)
    first, second = mmap.mmap(-1, MIB), mmap.mmap(-1, 2 * MIB)
    pool.give(first, now=1.0)
    pool.give(second, now=2.0)
    assert pool.take(3 * MIB) is None
    pool.give(mmap.mmap(-1, MIB), now=3.0)  # over 3 MiB: the oldest goes
    assert first.closed and pool.num_bytes == 3 * MIB
    assert pool.take(2 * MIB) is second and pool.num_reused == 1
    assert pool.release_idle(older_than=3.0) == 0
    assert pool.release(1) == MIB and pool.num_bytes == 0
    pool.give(mmap.mmap(-1, 4 * MIB), now=4.0)  # bigger than the whole pool
    assert pool.num_bytes == 0
    pool.check_integrity()


async def test_buffers_are_unmapped_off_the_event_loop_and_count_until_gone(
        start_cache, monkeypatch) -> None:
    """Unmapping takes ~70 ms per GiB, which every other call would wait out
    on the event loop; meanwhile the bytes are still resident, so a put that
    needs them waits until they are gone instead of exceeding the budget."""
    unmapped_on: list[threading.Thread] = []
    go = threading.Event()

    def slow_close(buffer: mmap.mmap) -> None:
        unmapped_on.append(threading.current_thread())
        go.wait(30)
        close_now(buffer)

    monkeypatch.setattr(memory_tier, "close_now", slow_close)
    running = await start_cache(memory_budget_bytes=8 * MIB, buffer_pool_bytes=0,
                                disk_dir=None, disk_budget_bytes=0)
    store = running.cache.store
    await put(running, "a", num_blocks=192)  # 6 MiB
    await running.client.delete("a")
    await wait_until(lambda: bool(unmapped_on), "the unmap started")
    assert unmapped_on[0] is not threading.main_thread()
    assert (await running.client.stats()).free_bytes == 2 * MIB  # a's 6 still resident
    store.check_integrity()
    waiting = asyncio.ensure_future(put(running, "b", num_blocks=192, seed=1))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # it cannot have its room before a's bytes are gone
    go.set()
    await asyncio.wait_for(waiting, 30)
    assert (await running.client.stats()).num_refused == 0
    store.check_integrity()
