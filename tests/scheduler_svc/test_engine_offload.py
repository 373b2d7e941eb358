"""The engine against a real worker and a real, deliberately slow cache service.

The scheduler core runs in the test's event loop, so the tests can watch each
request's state while the transfers are in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common import rpc_connections
from kvstash.common.layout import Layout
from kvstash.common.sampling import SamplingParams
from kvstash.launch.processes import Service
from scheduler_svc.__main__ import main as scheduler_main
from scheduler_svc.cache_link import CacheLink
from scheduler_svc.core.config import PreemptionMode, SchedulerConfig
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.streams import RequestStream
from scheduler_svc.worker_link import WorkerLink
from tests.integration.reference import reference_greedy
from tests.scheduler_svc.engine_services import NUM_BLOCKS, Harness, collect

_DEFAULT_ENGINE = EngineConfig()
MAX_TOKENS = 96
PROMPTS = {f"r{i}": [(i * 31 + j * 7 + 3) % 256 for j in range(10 + (i * 13) % 50)]
           for i in range(12)}


@pytest.fixture
async def harness(services: tuple[Service, Service]) -> AsyncIterator[Harness]:
    async with running_engine(*services) as h:
        yield h


@contextlib.asynccontextmanager
async def running_engine(cache_service: Service, worker: Service,
                         config: EngineConfig = _DEFAULT_ENGINE) -> AsyncIterator[Harness]:
    core = Scheduler(SchedulerConfig(
        num_blocks=NUM_BLOCKS, block_size=16, max_model_len=1024, vocab_size=258,
        eos_token_ids=(257,), preemption_mode=PreemptionMode.OFFLOAD,
        init_new_token_ratio=0.05, bytes_per_block=Layout(4, 16, 2, 32, "float64").bytes_per_block,
    ))
    channel = rpc_connections.insecure_channel(worker.address)
    cache = CacheClient(cache_service.address)
    engine = Engine(core, WorkerLink(channel, retry_s=0.1), CacheLink(cache), config)
    await engine.start()
    try:
        yield Harness(engine, core, cache)
    finally:
        await engine.close()
        await cache.close()
        await channel.close()


def submit_all(engine: Engine) -> dict[str, RequestStream]:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return {rid: engine.submit(rid, prompt, sampling) for rid, prompt in PROMPTS.items()}


async def wait_for_state(core: Scheduler, status: RequestStatus, timeout_s: float = 60) -> str:
    async def poll() -> str:
        while True:
            for rid in PROMPTS:
                req = core.get_request(rid)
                if req is not None and req.status is status:
                    return rid
            await asyncio.sleep(0.002)

    return await asyncio.wait_for(poll(), timeout_s)


async def assert_nothing_left(h: Harness) -> None:
    async def drained() -> None:
        while not h.core.is_idle:
            await asyncio.sleep(0.01)
        while True:  # snapshot deletions are asynchronous
            stats = await h.cache.stats()
            if stats.memory_snapshots + stats.disk_snapshots + stats.reserved_bytes == 0:
                return
            await asyncio.sleep(0.01)

    await asyncio.wait_for(drained(), 30)
    h.core.check_integrity()
    stats = h.core.stats()
    assert stats.num_free_blocks + stats.num_evictable_blocks == NUM_BLOCKS
    assert all(h.core.get_request(rid) is None for rid in PROMPTS)


@pytest.mark.parametrize(
    "state", [RequestStatus.OFFLOADING, RequestStatus.OFFLOADED, RequestStatus.RESUMING])
async def test_abort_in_offload_state_releases_blocks_and_snapshot(
    harness: Harness, state: RequestStatus
) -> None:
    streams = submit_all(harness.engine)
    victim = await wait_for_state(harness.core, state)
    harness.engine.abort(victim)
    results = dict(zip(streams, await asyncio.gather(*map(collect, streams.values())),
                       strict=True))
    assert results[victim][1] is RequestStatus.FINISHED_ABORTED
    for rid, (tokens, status) in results.items():
        if rid != victim:
            assert status is RequestStatus.FINISHED_LENGTH
            assert tokens == reference_greedy(PROMPTS[rid], MAX_TOKENS), rid
    await assert_nothing_left(harness)


async def test_steps_continue_while_an_offload_is_slow(harness: Harness) -> None:
    streams = submit_all(harness.engine)
    victim = await wait_for_state(harness.core, RequestStatus.OFFLOADING)
    others = [rid for rid in PROMPTS if rid != victim]

    def num_tokens_of_others() -> int:
        return sum(len(r.output_token_ids) for rid in others
                   if (r := harness.core.get_request(rid)) is not None)

    victim_req = harness.core.get_request(victim)
    assert victim_req is not None
    steps_before, tokens_before = harness.core.stats().num_steps, num_tokens_of_others()
    # Polled, not slept on: a loaded machine stretches both the steps and a
    # fixed sleep, which could outlast the copy.
    async with asyncio.timeout(30):
        while (harness.core.stats().num_steps < steps_before + 5
               or num_tokens_of_others() < tokens_before + 5):
            assert victim_req.status is RequestStatus.OFFLOADING
            await asyncio.sleep(0.002)
    assert victim_req.status is RequestStatus.OFFLOADING
    outcomes = await asyncio.gather(*map(collect, streams.values()))
    for rid, (tokens, status) in zip(streams, outcomes, strict=True):
        assert status is RequestStatus.FINISHED_LENGTH
        assert tokens == reference_greedy(PROMPTS[rid], MAX_TOKENS)
    await assert_nothing_left(harness)


async def test_snapshots_of_requests_failed_with_their_worker_are_deleted_at_once(
    own_services: tuple[Service, Service]
) -> None:
    """The worker dies while requests are offloaded, and they wait for it no
    time: their requests fail, and their snapshots leave the cache now, not
    once a worker answers again."""
    cache_service, worker = own_services
    async with running_engine(cache_service, worker, EngineConfig(worker_reconnect_s=0)) as h:
        streams = submit_all(h.engine)
        await wait_for_state(h.core, RequestStatus.OFFLOADED)
        assert (await h.cache.stats()).memory_snapshots > 0
        worker.kill()
        for stream in streams.values():  # each ends: the worker's error, or done before it
            while True:
                event = await asyncio.wait_for(stream.events.get(), 30)
                if isinstance(event, Exception) or event.finish_status is not None:
                    break
        async with asyncio.timeout(30):
            while not h.core.is_idle:  # copies to the dead worker fail too
                await asyncio.sleep(0.02)
            while (await h.cache.stats()).memory_snapshots:
                await asyncio.sleep(0.02)
        assert not h.engine.worker_up
        stats = h.core.stats()
        assert stats.num_free_blocks + stats.num_evictable_blocks == NUM_BLOCKS


async def outcome(stream: RequestStream) -> list[int] | errors.KvstashError:
    """The request's tokens once it finished, or the error it failed with."""
    tokens: list[int] = []
    while True:
        event = await asyncio.wait_for(stream.events.get(), 120)
        if isinstance(event, errors.KvstashError):
            return event
        tokens.extend(event.new_token_ids)
        if event.finish_status is not None:
            assert event.finish_status is RequestStatus.FINISHED_LENGTH
            return tokens


async def test_offloaded_and_waiting_requests_outlive_their_worker(
    own_services: tuple[Service, Service]
) -> None:
    """The worker dies while some requests run on it, some are offloaded and
    some wait: exactly those it held fail; once a new worker is up, the
    others restore from the cache or prefill there, each output exact."""
    cache_service, worker = own_services
    async with running_engine(cache_service, worker,
                              EngineConfig(worker_reconnect_s=120)) as h:
        at_loss: dict[str, RequestStatus] = {}
        lost: list[str] = []
        requests_on_worker = h.core.requests_on_worker

        def recorded() -> list[str]:  # what the core said when the worker was lost
            at_loss.update({rid: req.status for rid in PROMPTS
                            if (req := h.core.get_request(rid)) is not None})
            lost.extend(requests_on_worker())
            return lost

        h.core.requests_on_worker = recorded  # type: ignore[method-assign]
        # Fewer and shorter than submit_all's, enough to preempt: a restarted
        # worker on a busy machine must finish them in the test's time.
        sampling = SamplingParams(max_tokens=48, ignore_eos=True)
        streams = {rid: h.engine.submit(rid, PROMPTS[rid], sampling)
                   for rid in list(PROMPTS)[:6]}
        await wait_for_state(h.core, RequestStatus.OFFLOADED)
        worker.kill()
        async with asyncio.timeout(30):
            while not at_loss:
                await asyncio.sleep(0.01)
        assert RequestStatus.OFFLOADED in at_loss.values()
        restarted = worker.restart()
        try:
            outcomes = dict(zip(streams, await asyncio.gather(*map(outcome, streams.values())),
                                strict=True))
        finally:
            restarted.stop()
    assert lost
    for rid, result in outcomes.items():
        if rid in lost:
            assert isinstance(result, errors.Unavailable), (rid, result)
            assert "worker unavailable" in str(result)
        else:
            assert result == reference_greedy(PROMPTS[rid], 48), (rid, at_loss.get(rid))


@pytest.mark.parametrize("bad", ["0", "-1", "inf", "nan"])
@pytest.mark.parametrize(("flag", "name"), [("--transfer-timeout", "transfer_timeout_s"),
                                            ("--prefix-copy-timeout", "prefix_copy_timeout_s")])
def test_a_copy_timeout_that_is_no_time_is_refused_at_start(flag: str, name: str,
                                                            bad: str) -> None:
    """Else every offload and restore (or prefix-tier copy) would time out."""
    with pytest.raises(SystemExit, match=f"{name} must be a finite number of seconds > 0"):
        scheduler_main([flag, bad])


def snapshot_of(core: Scheduler, request_id: str) -> str:
    req = core.get_request(request_id)
    assert req is not None and req.snapshot is not None
    return req.snapshot.snapshot_id


async def test_an_abort_while_the_worker_is_away_deletes_the_snapshot_at_once(
    own_services: tuple[Service, Service]
) -> None:
    """The delete waited for the step loop's next turn, which waits for a
    worker: up to --worker-reconnect (30 s) with the snapshot pinned."""
    cache_service, worker = own_services
    async with running_engine(cache_service, worker) as h:
        submit_all(h.engine)
        victim = await wait_for_state(h.core, RequestStatus.OFFLOADED)
        snapshot_id = snapshot_of(h.core, victim)
        worker.kill()
        async with asyncio.timeout(30):
            while h.engine.worker_up:
                await asyncio.sleep(0.02)
        h.engine.abort(victim)
        async with asyncio.timeout(5):
            while True:
                try:
                    await h.cache.stat(snapshot_id)
                except errors.NotFound:
                    break
                await asyncio.sleep(0.02)


async def test_a_shutdown_deletes_the_snapshots_of_the_requests_it_ends(
    own_services: tuple[Service, Service]
) -> None:
    """A stopping scheduler aborts its calls' requests, then closes the
    engine: their deletes were cancelled with its tasks, and the snapshots
    stayed pinned until the cache's TTL (an hour)."""
    async with running_engine(*own_services) as h:
        submit_all(h.engine)
        victim = await wait_for_state(h.core, RequestStatus.OFFLOADED)
        snapshot_id = snapshot_of(h.core, victim)
        h.engine.abort(victim)
        await h.engine.close()
        with pytest.raises(errors.NotFound):
            await h.cache.stat(snapshot_id)
