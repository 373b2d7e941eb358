"""The prefix tier's fallbacks, the engine against a real worker and a real,
deliberately slow cache service (1 MiB/s: a 2-block segment takes ~0.13 s),
the core in the test's event loop: whatever goes wrong with the tier, the
request prefills instead and its tokens are the model's greedy ones."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common import rpc_connections
from kvstash.common.sampling import SamplingParams
from kvstash.launch.processes import Service
from kvstash.v1 import cache_pb2
from scheduler_svc.cache_link import CacheLink
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.kv_events import BlockRemoved, BlockStored, KvEvent
from scheduler_svc.core.outputs import OffloadCommand
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.worker_link import WorkerLink
from tests.integration.reference import reference_greedy
from tests.scheduler_svc.engine_services import NUM_BLOCKS, Harness, collect, start_services
from tests.scheduler_svc.test_prefix_tier import segment_ids

PROMPT = [(13 * j + 2) % 256 for j in range(70)]  # 2 segments of 32 tokens, and 6
SAMPLING = SamplingParams(max_tokens=8, ignore_eos=True)
EXPECTED = reference_greedy(PROMPT, 8)
MEMORY, DISK = cache_pb2.TIER_MEMORY, cache_pb2.TIER_DISK
TIERED_ENGINE = EngineConfig(transfer_timeout_s=10)


@contextlib.asynccontextmanager
async def tiered_engine(cache_service: Service, worker: Service, segment_blocks: int = 2,
                        config: EngineConfig = TIERED_ENGINE, quick_probe: bool = False,
                        kv_events: Callable[[list[KvEvent]], None] | None = None,
                        ) -> AsyncIterator[Harness]:
    """`quick_probe`: a cache that stops answering is seen down within a
    second. `kv_events`: told the prefix cache's events (Engine)."""
    core = Scheduler(SchedulerConfig(
        num_blocks=NUM_BLOCKS, block_size=16, max_model_len=1024, vocab_size=258,
        eos_token_ids=(257,), prefix_segment_blocks=segment_blocks,
        prefix_tier_salt="tiny|float64"))
    channel = rpc_connections.insecure_channel(worker.address)
    cache = CacheClient(cache_service.address)
    link = CacheLink(cache, probe_s=0.1, timeout_s=0.5) if quick_probe else CacheLink(cache)
    metrics = SchedulerMetrics(core, asyncio.get_running_loop())
    engine = Engine(core, WorkerLink(channel, retry_s=0.1), link, config, metrics=metrics,
                    kv_events=kv_events)
    await engine.start()
    try:
        yield Harness(engine, core, cache, metrics)
    finally:
        await engine.close()
        await cache.close()
        await channel.close()


async def idle(h: Harness) -> None:
    async def poll() -> None:
        while not h.core.is_idle:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), 30)
    h.engine.check_integrity()


async def serve_and_forget(h: Harness, request_id: str,
                           tiers: Sequence[int] = (MEMORY, MEMORY),
                           prompt: list[int] = PROMPT) -> list[str]:
    """Serves `prompt` (its segments saved), then empties the local prefix
    cache, as if the next request came to another instance; the segment ids,
    once the cache holds them in `tiers`."""
    tokens, _ = await collect(await h.engine.admit(request_id, prompt, SAMPLING))
    assert tokens == reference_greedy(prompt, 8)
    await idle(h)
    h.engine.flush_prefix_cache()
    ids = segment_ids(h.core, prompt)
    for _ in range(500):
        if await h.cache.find(ids) == list(tiers):
            return ids
        await asyncio.sleep(0.01)
    raise AssertionError(f"segments in {await h.cache.find(ids)}, not {tiers}")


async def test_a_segment_gone_between_lookup_and_load_is_prefilled(services) -> None:
    async with tiered_engine(*services) as h:
        ids = await serve_and_forget(h, "first")
        # The lookup found both; the cache drops the second before it is read.
        await h.cache.delete(ids[1])
        tokens, _ = await collect(h.engine.submit("second", PROMPT, SAMPLING, 2))
        assert tokens == EXPECTED
        await idle(h)
        stats = h.core.stats()
        assert (stats.num_tier_hit_tokens, stats.num_tier_load_failures) == (32, 1)
        # What was prefilled instead is stored again.
        assert stats.num_tier_saves == 3
        assert await h.cache.find(ids) == [MEMORY, MEMORY]


async def test_lookups_and_loads_are_measured(services) -> None:
    prompt = [(17 * j + 5) % 256 for j in range(70)]  # stored by no other test
    async with tiered_engine(*services) as h:
        await serve_and_forget(h, "first", prompt=prompt)  # a miss: nothing stored yet
        tokens, _ = await collect(await h.engine.admit("second", prompt, SAMPLING))
        assert tokens == reference_greedy(prompt, 8)
        await idle(h)
        assert h.metrics is not None
        registry = h.metrics.registry

        async def sample(name: str, **labels: str) -> float | None:
            # A scrape's thread: the collector reads the core on this loop.
            return await asyncio.to_thread(
                registry.get_sample_value, "kvstash_scheduler_" + name, labels)

        assert await sample("prefix_tier_lookups_total", result="miss") == 1
        assert await sample("prefix_tier_lookups_total", result="hit") == 1
        assert await sample("prefix_tier_found_segments_total", tier="memory") == 2
        assert await sample("prefix_tier_load_seconds_count") == 1
        assert await sample("prefix_tier_hit_tokens_total") == 64


async def test_an_abort_while_loading_lets_go_once_the_load_lands(services) -> None:
    async with tiered_engine(*services) as h:
        await serve_and_forget(h, "first")
        stream = await h.engine.admit("second", PROMPT, SAMPLING)
        req = h.core.get_request("second")
        assert req is not None

        async def loading() -> None:
            while req.status is not RequestStatus.LOADING:
                await asyncio.sleep(0.002)

        await asyncio.wait_for(loading(), 10)
        blocks = list(req.block_ids)
        h.engine.abort("second")
        _, status = await collect(stream)
        assert status is RequestStatus.FINISHED_ABORTED
        assert h.core.kv.pool.ref_cnt(blocks[0]) == 1  # the load still holds them
        await idle(h)
        pool = h.core.kv.pool
        assert pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks


async def test_blocks_a_load_evicted_are_announced_removed_though_no_step_follows(
        services) -> None:
    """A load's admission evicts cached blocks in a step that computes
    nothing; its request is aborted while loading, so no step follows: the
    removals still reach the KV events (a router would send their prefix here)."""
    big = [(23 * j + 7) % 256 for j in range(200)]  # 13 blocks: 6 segments, stored by no other
    small = [(29 * j + 11) % 256 for j in range(70)]  # 4 cached blocks
    events: list[KvEvent] = []
    async with tiered_engine(*services, kv_events=events.extend) as h:
        await serve_and_forget(h, "big", tiers=[MEMORY] * 6, prompt=big)
        tokens, _ = await collect(await h.engine.admit("small", small, SAMPLING))
        assert tokens == reference_greedy(small, 8)
        await idle(h)
        cached = set(h.core.prompt_block_hashes(small))
        assert cached <= {e.block_hash for e in events if isinstance(e, BlockStored)}
        stream = await h.engine.admit("again", big, SAMPLING)  # 13 blocks: 12 free, 1 evicted
        req = h.core.get_request("again")
        assert req is not None
        await until(lambda: req.status is RequestStatus.LOADING, "loading")
        h.engine.abort("again")
        await collect(stream)
        await idle(h)
        evicted = {b for b in cached if not h.core.kv.pool.cached_run([b])}
        assert evicted
        await until(lambda: evicted <= {e.block_hash for e in events
                                        if isinstance(e, BlockRemoved)},
                    "the evictions announced", timeout_s=5)


async def test_a_cache_that_is_down_leaves_every_prompt_to_prefill(own_services) -> None:
    cache_service, worker = own_services
    async with tiered_engine(cache_service, worker) as h:
        await serve_and_forget(h, "first")
        cache_service.stop()
        tokens, _ = await collect(await h.engine.admit("second", PROMPT, SAMPLING))
        assert tokens == EXPECTED
        await idle(h)
        stats = h.core.stats()
        assert stats.num_tier_hit_tokens == 0 and stats.num_tier_save_failures == 0


async def until(condition, what: str, timeout_s: float = 10.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.002)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"never: {what}") from None


async def test_a_cache_killed_during_a_save_or_a_load_costs_only_the_tier(own_services) -> None:
    cache_service, worker = own_services
    async with tiered_engine(cache_service, worker) as h:
        stream = await h.engine.admit("first", PROMPT, SAMPLING)
        # At 1 MiB/s a segment's save takes ~0.13 s: the cache dies under it.
        await until(lambda: h.core.tier.saves, "a save in flight")
        cache_service.kill()
        tokens, _ = await collect(stream)
        assert tokens == EXPECTED
        await idle(h)
        assert h.core.stats().num_tier_save_failures >= 1
        await until(lambda: not h.core.preemption.cache_available, "the cache seen gone")
        restarted = cache_service.restart()
        try:
            await until(lambda: h.core.preemption.cache_available, "the cache seen back")
            # The failed segments are not remembered as stored: the next
            # request to prefill the prompt stores them (once the worker's
            # channel is back too).
            for attempt in range(20):
                ids = segment_ids(h.core, PROMPT)
                if await h.cache.find(ids) == [MEMORY, MEMORY]:
                    break
                tokens, _ = await collect(await h.engine.admit(f"again{attempt}", PROMPT,
                                                               SAMPLING))
                assert tokens == EXPECTED
                await idle(h)
                h.engine.flush_prefix_cache()
            else:
                raise AssertionError("the segments were never stored again")
            stream = await h.engine.admit("third", PROMPT, SAMPLING)
            await until(lambda: h.core.stats().num_loading, "a load in flight")
            restarted.kill()
            tokens, _ = await collect(stream)
            assert tokens == EXPECTED
            await idle(h)
            assert h.core.stats().num_tier_load_failures == 1
        finally:
            restarted.stop()


async def test_a_prompt_whose_lookup_timed_out_is_saved(own_services) -> None:
    """The cache pauses (SIGSTOP) while the request is looked up: the lookup
    times out (0.5 s), and the prompt, never saved here, is saved once the
    cache answers again."""
    cache_service, worker = own_services
    async with tiered_engine(cache_service, worker) as h:
        cache_service.process.send_signal(signal.SIGSTOP)
        try:
            admitting = asyncio.create_task(h.engine.admit("a", PROMPT, SAMPLING))
            await asyncio.sleep(0.7)
        finally:
            cache_service.process.send_signal(signal.SIGCONT)
        tokens, _ = await collect(await admitting)
        assert tokens == EXPECTED
        await idle(h)
        assert h.core.stats().num_tier_saves == 2
        assert await h.cache.find(segment_ids(h.core, PROMPT)) == [MEMORY, MEMORY]


async def test_instances_with_other_segment_sizes_share_a_cache_without_failed_loads(
        services) -> None:
    """B stores 1-block segments, A (2-block segments) looks the same prompt
    up in the same cache: it finds none of B's, and reads only its own."""
    prompt = [(19 * j + 4) % 256 for j in range(70)]  # stored by no other test
    async with tiered_engine(*services, segment_blocks=1) as b:
        await serve_and_forget(b, "b", tiers=[MEMORY] * 4, prompt=prompt)
    async with tiered_engine(*services) as a:
        for request_id in ("a0", "a1"):
            tokens, _ = await collect(await a.engine.admit(request_id, prompt, SAMPLING))
            assert tokens == reference_greedy(prompt, 8)
            await idle(a)
            a.engine.flush_prefix_cache()
        stats = a.core.stats()
        assert (stats.num_tier_load_failures, stats.num_tier_hit_tokens) == (0, 64)  # a0's


# Longer than any test may wait: where a test must not wait for a copy to a
# cache that hangs, its bound.
LONG_S = 30.0


async def test_a_cache_known_down_is_neither_asked_nor_read(own_services) -> None:
    """Stopped (SIGSTOP: a hung process, a black-holed network) and seen
    down: admissions wait for no lookup, and a request whose lookup found
    segments just before prefills at once instead of waiting out a load."""
    cache_service, worker = own_services
    config = EngineConfig(transfer_timeout_s=LONG_S, prefix_copy_timeout_s=LONG_S)
    async with tiered_engine(cache_service, worker, config=config, quick_probe=True) as h:
        await serve_and_forget(h, "first")
        await until(lambda: h.core.preemption.cache_available, "the cache seen up")
        cache_service.process.send_signal(signal.SIGSTOP)
        try:
            await until(lambda: not h.core.preemption.cache_available, "the cache seen down")
            started = time.monotonic()
            for i in range(10):  # 5 s, were each to wait for its lookup
                stream = await h.engine.admit(f"r{i}", PROMPT, SAMPLING)
                h.engine.abort(f"r{i}")
                await collect(stream)
            took = time.monotonic() - started
            assert took < 2.5, f"10 admissions took {took:.2f} s: they waited for lookups"
            started = time.monotonic()
            # stored_segments=2: what its lookup answered just before the hang.
            tokens, _ = await collect(h.engine.submit("second", PROMPT, SAMPLING, 2))
            took = time.monotonic() - started
            assert tokens == EXPECTED
            assert took < LONG_S / 3, f"took {took:.1f} s: it waited for a load"
            assert h.core.stats().num_tier_load_failures == 0
        finally:
            cache_service.process.send_signal(signal.SIGCONT)


async def test_a_load_from_a_cache_that_hangs_unseen_gives_up_after_its_bound(
        own_services) -> None:
    """The cache hangs between a request's lookup and its load, and the
    watcher has not seen it yet: the load gives up after prefix_copy_timeout_s,
    not transfer_timeout_s, and the request prefills."""
    cache_service, worker = own_services
    config = EngineConfig(transfer_timeout_s=LONG_S, prefix_copy_timeout_s=1)
    async with tiered_engine(cache_service, worker, config=config) as h:
        await serve_and_forget(h, "first")
        cache_service.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            tokens, _ = await collect(h.engine.submit("second", PROMPT, SAMPLING, 2))
            took = time.monotonic() - started
            assert tokens == EXPECTED
            assert took < LONG_S / 3, f"took {took:.1f} s: the load waited past its bound"
            assert h.core.stats().num_tier_load_failures == 1
        finally:
            cache_service.process.send_signal(signal.SIGCONT)


async def test_saves_to_a_cache_that_hangs_unseen_hold_their_blocks_for_their_bound_only(
        own_services) -> None:
    """The cache hangs just after a request's lookup: its saves hold their
    blocks until prefix_copy_timeout_s, not transfer_timeout_s, so a request
    that needs those blocks waits that long at most."""
    cache_service, worker = own_services
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    config = EngineConfig(transfer_timeout_s=LONG_S, prefix_copy_timeout_s=1)
    async with tiered_engine(cache_service, worker, config=config) as h:
        admitting = asyncio.create_task(h.engine.admit("a", PROMPT, one))
        await until(lambda: h.core.get_request("a") is not None, "a admitted")
        cache_service.process.send_signal(signal.SIGSTOP)  # after a's lookup answered
        try:
            await collect(await admitting)
            await until(lambda: h.core.tier.saves, "a's saves in flight")
            big = [(11 * j + 7) % 256 for j in range(200)]  # 13 blocks: 4 are a's saves'
            started = time.monotonic()
            tokens, _ = await collect(await h.engine.admit("big", big, one))
            took = time.monotonic() - started
            assert tokens == reference_greedy(big, 1)
            assert took < LONG_S / 3, f"first token after {took:.1f} s: it waited for saves"
        finally:
            cache_service.process.send_signal(signal.SIGCONT)


async def worker_reaches_cache(worker: Service) -> None:
    """Returns once the worker's channel to a restarted cache is back: a
    throwaway (pinned) offload of one block goes through."""
    async with rpc_connections.insecure_channel(worker.address) as channel:
        link = WorkerLink(channel)
        for attempt in range(100):
            probe = OffloadCommand("probe", f"probe-{attempt}", [0], 1)
            if (await link.offload(probe, 5.0)).num_bytes is not None:
                return
            await asyncio.sleep(0.1)
    raise AssertionError("the worker never reached the cache again")


@contextlib.contextmanager
def spilling_services(tmp_path: Path) -> Iterator[tuple[Service, Service]]:
    """A cache whose segments may hold 2% of 8 MiB (one 128 KiB segment): of
    a prompt's two, the first is spilled to its disk tier."""
    cache, worker = start_services(tmp_path, (
        "--memory-budget", "8MiB", "--unpinned-share", "0.02",
        "--disk-dir", str(tmp_path / "disk"), "--disk-budget", "64MiB"))
    try:
        yield cache, worker
    finally:
        worker.stop()
        cache.stop()


async def test_a_damaged_segment_is_dropped_prefilled_and_stored_anew(tmp_path: Path) -> None:
    with spilling_services(tmp_path) as services:
        async with tiered_engine(*services) as h:
            ids = await serve_and_forget(h, "first", tiers=[DISK, MEMORY])
            (path,) = (tmp_path / "disk").glob(ids[0] + "~*")
            data = bytearray(path.read_bytes())
            data[-1000] ^= 0x01  # one bit of the payload's end
            path.write_bytes(bytes(data))
            tokens, _ = await collect(await h.engine.admit("second", PROMPT, SAMPLING))
            assert tokens == EXPECTED
            await idle(h)
            stats = h.core.stats()
            assert (stats.num_tier_load_failures, stats.num_tier_hit_tokens) == (1, 0)
            # Both sent again: the damaged one stored anew, the other found there.
            assert stats.num_tier_saves == 4
            h.engine.flush_prefix_cache()
            tokens, _ = await collect(await h.engine.admit("third", PROMPT, SAMPLING))
            assert tokens == EXPECTED
            await idle(h)
            assert h.core.stats().num_tier_hit_tokens == 64


async def test_a_spilled_segment_is_read_after_a_cache_restart(tmp_path: Path) -> None:
    with spilling_services(tmp_path) as (cache_service, worker):
        async with tiered_engine(cache_service, worker) as h:
            ids = await serve_and_forget(h, "first", tiers=[DISK, MEMORY])
            cache_service.kill()
            restarted = cache_service.restart()  # the memory tier is gone, the disk's found
            try:
                await worker_reaches_cache(worker)
                assert await h.cache.find(ids) == [DISK, cache_pb2.TIER_UNSPECIFIED]
                tokens, _ = await collect(await h.engine.admit("second", PROMPT, SAMPLING))
                assert tokens == EXPECTED
                await idle(h)
                assert h.core.stats().num_tier_hit_tokens == 32
            finally:
                restarted.stop()
