"""--bandwidth-limit: puts and gets are paced to the configured rate, all
streams together, without the server reading ahead. Only lower bounds on
time are asserted: a busy machine may always be slower."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from cache_helpers import MIB, make_layout, make_payload, start_cache_process

from cache_svc import stream_calls
from cache_svc.__main__ import build_parser, config_from_args
from cache_svc.config import CacheConfig
from cache_svc.limiter import BandwidthLimiter, ByteLimiter
from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient

LAYOUT = make_layout()  # 32 KiB blocks
SLACK = 0.9  # timer granularity: a paced transfer may end a hair early


async def test_put_and_get_take_at_least_size_over_limit(start_cache) -> None:
    limit = 8 * MIB
    running = await start_cache(bandwidth_limit_bytes_per_s=limit)
    store = running.cache.store
    data = make_payload(LAYOUT, 128)  # 4 MiB, 4 chunks of 1 MiB
    loop = asyncio.get_running_loop()
    started = loop.time()
    overrun = 0.0

    async def watch() -> None:
        # The server pulls bytes out of gRPC no faster than the limit allows
        # (plus the chunk being accepted), so nothing piles up on its side.
        nonlocal overrun
        while True:
            allowed = limit * (loop.time() - started) + MIB
            overrun = max(overrun, store.stats().bytes_in - allowed)
            await asyncio.sleep(0.01)

    watcher = asyncio.ensure_future(watch())
    await running.client.put("slow", LAYOUT, 128, 0, data)
    put_s = loop.time() - started
    watcher.cancel()
    started = loop.time()
    out = np.zeros_like(data)
    await running.client.get_into("slow", memoryview(out))
    get_s = loop.time() - started
    assert put_s >= SLACK * data.nbytes / limit, f"4 MiB put at 8 MiB/s took {put_s:.2f} s"
    assert get_s >= SLACK * data.nbytes / limit, f"4 MiB get at 8 MiB/s took {get_s:.2f} s"
    assert overrun <= 0, f"server read {overrun / MIB:.1f} MiB ahead of the limit"
    assert out.tobytes() == data.tobytes()


async def test_limit_is_shared_by_concurrent_streams(start_cache) -> None:
    limit = 16 * MIB
    running = await start_cache(bandwidth_limit_bytes_per_s=limit)
    payloads = [make_payload(LAYOUT, 64, seed=i) for i in range(4)]  # 4 x 2 MiB
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with CacheClient(running.client.address, chunk_bytes=MIB) as other:
        clients = [running.client, other]
        await asyncio.gather(*(clients[i % 2].put(f"s{i}", LAYOUT, 64, 0, p)
                               for i, p in enumerate(payloads)))
    elapsed = loop.time() - started
    assert elapsed >= SLACK * 8 * MIB / limit, f"8 MiB over 4 streams took {elapsed:.2f} s"
    for i, p in enumerate(payloads):
        assert (await running.client.get(f"s{i}"))[1] == p.tobytes()


async def test_bandwidth_limiter_books_in_order_and_refunds_cancelled_tail() -> None:
    # Unlimited returns without ever suspending (checked by stepping the
    # coroutine by hand, not with a stopwatch).
    unlimited = BandwidthLimiter(0).take(1 << 40)
    with pytest.raises(StopIteration):
        unlimited.send(None)

    loop = asyncio.get_running_loop()
    pace = BandwidthLimiter(10 * MIB)  # 1 MiB per 0.1 s
    first = asyncio.ensure_future(pace.take(MIB))
    await asyncio.sleep(0)
    first_end = pace._booked_until
    second = asyncio.ensure_future(pace.take(MIB))
    await asyncio.sleep(0)
    assert pace._booked_until == pytest.approx(first_end + 0.1)  # booked after first
    second.cancel()  # the last booking: its 0.1 s goes back to the link
    with pytest.raises(asyncio.CancelledError):
        await second
    assert pace._booked_until == first_end
    await first
    assert loop.time() >= first_end
    started = loop.time()
    await pace.take(MIB)
    assert loop.time() - started >= 0.09  # lower bounds only: load only adds time


async def test_taking_no_bytes_waits_for_no_booking() -> None:
    """A put's read of its end of stream paces 0 bytes: it waited behind
    every other stream's booking before it could commit."""
    pace = BandwidthLimiter(1)
    booked = asyncio.ensure_future(pace.take(1000))  # the link is booked 1000 s ahead
    await asyncio.sleep(0)
    nothing = pace.take(0)
    with pytest.raises(StopIteration):  # returned without suspending
        nothing.send(None)
    booked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await booked


async def test_a_refused_put_books_no_link_time(start_cache, monkeypatch) -> None:
    """A refusal read the client's end of stream only after booking a whole
    MAX_CHUNK_BYTES of the link (32 s at this limit; the drain's own 5 s limit
    is lifted here so that shows): each duplicate save was answered that late,
    and every other stream waited behind it."""
    monkeypatch.setattr(stream_calls, "DRAIN_LIMIT_S", 60.0)
    running = await start_cache(bandwidth_limit_bytes_per_s=128 * 1024)
    data = make_payload(LAYOUT, 1)  # 32 KiB: 0.25 s at the limit
    await running.client.put("once", LAYOUT, 1, 0, data)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(errors.AlreadyExists):
        await running.client.put("once", LAYOUT, 1, 0, data)
    refused_s = loop.time() - started
    assert refused_s < 16, f"a refusal that sent no payload took {refused_s:.1f} s"
    assert (await running.client.get("once"))[1] == data.tobytes()


async def test_a_waiter_cancelled_as_bytes_come_free_leaks_nothing() -> None:
    """A waiting put or get whose call is cancelled, and another call's
    release landing before the cancelled one runs again: the bytes go to the
    next waiter, not to the cancelled one, and the release raises nothing."""
    limiter = ByteLimiter(10)
    await limiter.acquire(10)
    cancelled = asyncio.ensure_future(limiter.acquire(5))
    behind = asyncio.ensure_future(limiter.acquire(8))
    await asyncio.sleep(0)  # both queued
    cancelled.cancel()
    limiter.release(10)  # before the cancelled task runs
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await behind
    assert limiter.in_use == 8 and not limiter._waiters
    limiter.release(8)
    async with limiter.hold(10):
        assert limiter.in_use == 10
    assert limiter.in_use == 0


def test_flag_parses_sizes_and_config_refuses_negative() -> None:
    args = build_parser().parse_args(["--bandwidth-limit", "2MiB"])
    assert config_from_args(args).bandwidth_limit_bytes_per_s == 2 * MIB
    assert config_from_args(build_parser().parse_args([])).bandwidth_limit_bytes_per_s == 0
    with pytest.raises(ValueError, match="bandwidth_limit_bytes_per_s is -1"):
        CacheConfig(bandwidth_limit_bytes_per_s=-1)


async def test_limited_process_stays_within_memory_bound(tmp_path) -> None:
    # 4 concurrent 4 MiB puts against 16 MiB/s: at least a second, and the
    # streams waiting for their turn hold nothing beyond the in-flight bounds.
    process = start_cache_process("--memory-budget", "32MiB", "--max-inflight", "12MiB",
                                  "--bandwidth-limit", "16MiB")
    try:
        baseline = process.rss_bytes()
        payloads = [make_payload(LAYOUT, 128, seed=i) for i in range(4)]
        loop = asyncio.get_running_loop()
        async with CacheClient(process.address, chunk_bytes=MIB) as client:
            started = loop.time()
            await asyncio.gather(*(client.put(f"p{i}", LAYOUT, 128, 0, p)
                                   for i, p in enumerate(payloads)))
            elapsed = loop.time() - started
            outs = [np.zeros_like(p) for p in payloads]
            await asyncio.gather(*(client.get_into(f"p{i}", memoryview(o))
                                   for i, o in enumerate(outs)))
        peak = process.rss_bytes("VmHWM")
    finally:
        process.kill()
    assert elapsed >= SLACK * 16 * MIB / (16 * MIB), f"16 MiB at 16 MiB/s took {elapsed:.2f} s"
    for p, o in zip(payloads, outs, strict=True):
        assert o.tobytes() == p.tobytes()
    config = CacheConfig(memory_budget_bytes=32 * MIB, max_inflight_bytes=12 * MIB)
    limit = baseline + 32 * MIB + config.overhead_bytes(4)  # the documented bound
    assert peak <= limit, f"peak RSS {peak / MIB:.0f} MiB > {limit / MIB:.0f} MiB"
