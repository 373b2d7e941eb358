"""P/D disaggregation over real processes: a prefill and a decode instance
(each a scheduler and its worker) sharing one cache service.

Every output is checked against the model's own greedy output, whatever
failed on the way, and both schedulers run with --check-integrity: a broken
invariant anywhere exits that scheduler, which each scenario's end checks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstash.client import Client
from kvstash.common import wire
from kvstash.common.layout import Layout
from kvstash.common.wire import layout_from_proto
from kvstash.launch.processes import Service, start_service
from kvstash.launch.stack import Stack, StackConfig, running_stack
from kvstash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.reference import reference_greedy
from tests.integration.workload import cache_stats, expected_outputs, run_workload

MAX_TOKENS = 40
# A decode instance that reserves for every remaining token never needs to
# preempt: it refuses instead.
FULL_RESERVATION = ("--init-new-token-ratio", "1", "--min-new-token-ratio-factor", "1")


def small_prompts(n: int = 8) -> list[list[int]]:
    return [[(i * 17 + j * 5 + 1) % 256 for j in range(8 + (i * 11) % 40)] for i in range(n)]


def pd_config(*, decode: tuple[str, ...] = (), prefill_wait: float = 120.0,
              num_blocks: int = 64) -> StackConfig:
    return StackConfig(
        pd=True, num_blocks=num_blocks, scheduler_args=("--check-integrity",),
        worker_args=(), decode_scheduler_args=decode,
        prefill_scheduler_args=("--handoff-wait", str(prefill_wait)))


async def complete_all(address: str, prompts: list[list[int]],
                       max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    async with Client(address) as client:
        results = await asyncio.gather(*[
            client.complete(p, max_tokens=max_tokens, ignore_eos=True) for p in prompts])
    return [r.token_ids for r in results]


def reference(prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return [list(reference_greedy(p, max_tokens)) for p in prompts]


async def stats(service: Service | None) -> scheduler_pb2.SchedulerStats:
    assert service is not None
    async with Client(service.address) as client:
        return await client.stats()


async def drained(service: Service | None, timeout_s: float = 15.0) -> scheduler_pb2.SchedulerStats:
    """Its stats once it holds no request and every block is back."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        s = await stats(service)
        idle = not (s.num_running_prefill or s.num_running_decode or s.num_waiting
                    or s.num_offloaded or s.num_reserved or s.num_handed_off)
        if idle and s.num_free_blocks + s.num_evictable_blocks == s.num_total_blocks:
            return s
        assert loop.time() < deadline, f"{service.name} never drained: {s}"  # type: ignore[union-attr]
        await asyncio.sleep(0.05)


async def until_decoding(stack: Stack, num_requests: int, timeout_s: float = 30.0) -> None:
    """Returns once the decode instance decodes `num_requests` requests."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (await stats(stack.decode_scheduler)).num_running_decode < num_requests:
        assert loop.time() < deadline, f"never {num_requests} decoding"
        await asyncio.sleep(0.01)


def assert_alive(stack: Stack, *services: Service | None) -> None:
    """Schedulers run with --check-integrity exit on a broken invariant."""
    for service in services or stack.services:
        assert service is not None and service.process.poll() is None, (
            f"{service.name} exited: {service.log_path.read_text()[-3000:]}")  # type: ignore[union-attr]


def decode_stub(stack: Stack) -> tuple[grpc.aio.Channel, scheduler_pb2_grpc.SchedulerStub]:
    assert stack.decode_scheduler is not None
    channel = grpc.aio.insecure_channel(stack.decode_scheduler.address)
    return channel, scheduler_pb2_grpc.SchedulerStub(channel)


async def kv_layout(stack: Stack) -> Layout:
    async with grpc.aio.insecure_channel(stack.worker.address) as channel:
        info = await worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest())
    return layout_from_proto(info.kv_layout)


def reserve_request(request_id: str, prompt: list[int], layout: Layout, max_tokens: int = 8,
                    block_size: int | None = None, sent: common_pb2.KvLayout | None = None
                    ) -> scheduler_pb2.ReserveBlocksRequest:
    """What a prefill instance with `layout` sends, saying it whole (or
    `sent`), or, with another `block_size`, by its sizes only (as an older
    instance does)."""
    whole = sent or (wire.layout_to_proto(layout) if block_size is None else None)
    return scheduler_pb2.ReserveBlocksRequest(
        request_id=request_id, prompt=scheduler_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        block_size=block_size or layout.block_size, bytes_per_block=layout.bytes_per_block,
        layout=whole)


@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Unpressured, for the scenarios that leave both instances intact."""
    config = pd_config(decode=("--reservation-timeout", "1"))
    with running_stack(config, tmp_path_factory.mktemp("pd-logs")) as stack:
        yield stack


async def test_pd_gives_the_mixed_tokens_under_decode_pressure(tmp_path: Path) -> None:
    """The oracle: the pressured workload of test_preemption, every request
    prefilled on one instance and decoded on the other, whose small pool and
    optimistic reservations make it preempt and offload over and over."""
    config = pd_config(num_blocks=16, decode=("--init-new-token-ratio", "0.05"))
    with running_stack(config, tmp_path) as stack:
        outcome = await run_workload(stack.address)
        prefill = await drained(stack.scheduler)
        decode = await drained(stack.decode_scheduler)
        cache = await cache_stats(stack.cache.address)
        assert_alive(stack)
    assert [r.token_ids for r in outcome.results] == expected_outputs()
    num_requests = len(outcome.results)
    assert prefill.num_handoffs == num_requests and prefill.num_handoff_failures == 0
    assert prefill.bytes_handed_off > 0
    assert decode.num_reservations_accepted == num_requests
    # Each request, token and restore counted once over the pair: where it
    # finished, where it was sampled, and hand-offs apart from preemptions.
    assert (prefill.num_finished, decode.num_finished) == (0, num_requests)
    assert prefill.num_generation_tokens + decode.num_generation_tokens == sum(
        len(r.token_ids) for r in outcome.results)
    assert prefill.num_generation_tokens == num_requests  # each one's first
    assert decode.bytes_handed_in == prefill.bytes_handed_off
    assert decode.bytes_restored <= decode.bytes_offloaded
    assert decode.num_preemptions_offload + decode.num_preemptions_recompute > 0
    # The decode instance's preemptions reach the client's usage.
    assert sum(r.usage.num_preemptions for r in outcome.results if r.usage) >= (
        decode.num_preemptions_offload + decode.num_preemptions_recompute)
    assert prefill.num_preemptions_offload + prefill.num_preemptions_recompute == 0
    assert cache.memory_snapshots + cache.disk_snapshots == 0


async def test_a_full_decode_instance_refuses_and_never_preempts(tmp_path: Path) -> None:
    """Reservations that would eat into its running requests' are refused;
    the prefill instance retries and every request still completes there."""
    prompts = small_prompts(12)
    config = pd_config(num_blocks=24, decode=FULL_RESERVATION)
    with running_stack(config, tmp_path) as stack:
        outputs = await complete_all(stack.address, prompts)
        prefill = await drained(stack.scheduler)
        decode = await drained(stack.decode_scheduler)
        assert_alive(stack)
    assert outputs == reference(prompts)
    assert decode.num_reservations_refused > 0
    assert decode.num_reservations_accepted == len(prompts) == prefill.num_handoffs
    assert decode.num_preemptions_offload == decode.num_preemptions_recompute == 0


async def test_reservations_expire_and_are_validated(pd_stack: Stack) -> None:
    layout = await kv_layout(pd_stack)
    channel, stub = decode_stub(pd_stack)
    async with channel:
        before = await stats(pd_stack.decode_scheduler)
        prompt = list(range(40))
        answer = await stub.ReserveBlocks(reserve_request("held", prompt, layout))
        assert answer.accepted and answer.expires_in_s == 1.0
        held = await stats(pd_stack.decode_scheduler)
        assert held.num_reserved == 1
        assert held.num_free_blocks + held.num_evictable_blocks == (
            before.num_free_blocks + before.num_evictable_blocks - 3)  # 40 tokens in blocks of 16
        with pytest.raises(grpc.aio.AioRpcError) as dup:
            await stub.ReserveBlocks(reserve_request("held", prompt, layout))
        assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS
        after = await drained(pd_stack.decode_scheduler, timeout_s=5)
        assert after.num_reservations_expired == before.num_reservations_expired + 1
        with pytest.raises(grpc.aio.AioRpcError) as used:
            await anext(aiter(stub.Decode(scheduler_pb2.DecodeRequest(
                request_id="held", snapshot_id="s1", num_tokens=40, first_token_id=1))))
        assert used.value.code() == grpc.StatusCode.NOT_FOUND

        bad = {
            "one token": (reserve_request("r1", prompt, layout, max_tokens=1),
                          grpc.StatusCode.INVALID_ARGUMENT),
            "layout": (reserve_request("r2", prompt, layout, block_size=32),
                       grpc.StatusCode.FAILED_PRECONDITION),
            # Blocks of the same bytes in another shape (as bf16 and fp16 are)
            # were taken, and every hand-in's restore then failed.
            "same bytes": (reserve_request("r2", prompt, layout, sent=wire.layout_to_proto(
                dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads * 2,
                                    head_dim=layout.head_dim // 2))),
                           grpc.StatusCode.FAILED_PRECONDITION),
            "dtype": (reserve_request("r2", prompt, layout, sent=common_pb2.KvLayout(
                num_layers=1, block_size=layout.block_size, num_kv_heads=1, head_dim=1,
                dtype="int4")), grpc.StatusCode.INVALID_ARGUMENT),
            "id": (reserve_request("bad id!", prompt, layout), grpc.StatusCode.INVALID_ARGUMENT),
            "vocabulary": (reserve_request("r3", [10**6], layout),
                           grpc.StatusCode.INVALID_ARGUMENT),
        }
        for what, (request, code) in bad.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ReserveBlocks(request)
            assert err.value.code() == code, what
            assert err.value.details(), what
    # Only a decode instance takes reservations.
    async with grpc.aio.insecure_channel(pd_stack.address) as prefill_channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await scheduler_pb2_grpc.SchedulerStub(prefill_channel).ReserveBlocks(
                reserve_request("r4", prompt, layout))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert_alive(pd_stack)


async def test_client_abort_and_disconnect_release_both_sides(pd_stack: Stack) -> None:
    prompt = small_prompts(1)[0]
    async with Client(pd_stack.address) as client:
        # Disconnect: the call is cancelled once the decode instance streams.
        received: list[int] = []

        async def consume() -> None:
            async for delta in client.generate(prompt, max_tokens=400, ignore_eos=True):
                received.extend(delta.token_ids)

        task = asyncio.create_task(consume())
        while len(received) < 5:
            await asyncio.sleep(0.01)
        await until_decoding(pd_stack, 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # Abort by id while decoding remotely.
        stream = client.generate(prompt, max_tokens=400, ignore_eos=True, request_id="to-abort")
        first = await anext(aiter(stream))
        await until_decoding(pd_stack, 1)
        await client.abort(first.request_id)
        async for delta in stream:
            last = delta
        assert last.finish_reason == "abort"
    prefill = await drained(pd_stack.scheduler)
    await drained(pd_stack.decode_scheduler)
    assert prefill.num_handed_off == 0
    cache = await cache_stats(pd_stack.cache.address)
    assert cache.memory_snapshots + cache.disk_snapshots == 0
    assert_alive(pd_stack)


async def test_decode_instance_refusing_all_means_decoding_on_the_prefill_instance(
        tmp_path: Path) -> None:
    prompts = small_prompts(4)
    config = pd_config(prefill_wait=0.5, decode=("--max-num-seqs", "1",
                                                 "--reservation-timeout", "600"))
    with running_stack(config, tmp_path) as stack:
        layout = await kv_layout(stack)
        channel, stub = decode_stub(stack)
        async with channel:  # its only seat, held
            assert (await stub.ReserveBlocks(reserve_request("seat", [1, 2, 3], layout))).accepted
            outputs = await complete_all(stack.address, prompts)
            await stub.Abort(scheduler_pb2.AbortRequest(request_id="seat"))
        prefill = await drained(stack.scheduler)
        decode = await drained(stack.decode_scheduler)
        assert_alive(stack)
    assert outputs == reference(prompts)
    # Each copied out, then, refused past the wait, taken back from the cache.
    assert prefill.num_handoffs == prefill.num_handoff_failures == len(prompts)
    assert decode.num_reservations_refused >= len(prompts)


async def test_prefill_instances_sending_one_request_id_do_not_collide(tmp_path: Path) -> None:
    """Two prefill instances number their requests each their own way: one
    (the raw stub here) holds a reservation for "same" on the decode
    instance, then releases it by that id, while the prefill instance's own
    "same" is handed off and decodes there. Neither gets in the other's way."""
    prompt = small_prompts(1)[0]
    config = pd_config(prefill_wait=0.5, decode=("--reservation-timeout", "600"))
    with running_stack(config, tmp_path) as stack:
        layout = await kv_layout(stack)
        channel, stub = decode_stub(stack)
        async with channel, Client(stack.address) as client:
            assert (await stub.ReserveBlocks(reserve_request("same", [1, 2, 3], layout))).accepted
            work = asyncio.create_task(client.complete(
                prompt, max_tokens=200, ignore_eos=True, request_id="same"))
            await until_decoding(stack, 1)
            await stub.Abort(scheduler_pb2.AbortRequest(request_id="same"))  # its release
            result = await work
        prefill = await drained(stack.scheduler)
        decode = await drained(stack.decode_scheduler)
        assert_alive(stack)
    assert result.token_ids == reference([prompt], 200)[0]
    assert prefill.num_handoffs == 1 and prefill.num_handoff_failures == 0
    assert prefill.num_recomputed_tokens == 0
    assert decode.num_finished == 1 and decode.num_reservations_accepted == 2


async def test_decode_instance_killed_during_and_before_handoff(tmp_path: Path) -> None:
    prompts = small_prompts(6)
    with running_stack(pd_config(prefill_wait=0.5), tmp_path) as stack:
        work = asyncio.create_task(complete_all(stack.address, prompts, max_tokens=200))
        await until_decoding(stack, 3)
        assert stack.decode_scheduler is not None
        stack.decode_scheduler.kill()  # requests mid-decode there
        during = await work
        prefill = await stats(stack.scheduler)
        # Now it is gone before any hand-off: each is copied out, asks in
        # vain, and is taken back from the cache to decode here.
        before = await complete_all(stack.address, prompts)
        after = await drained(stack.scheduler)
        cache = await cache_stats(stack.cache.address)
        assert_alive(stack, stack.scheduler, stack.worker, stack.cache)
    assert during == reference(prompts, 200)
    assert before == reference(prompts)
    assert prefill.num_handoff_failures >= 3
    assert after.num_handoffs == prefill.num_handoffs + len(prompts)
    assert after.num_handoff_failures == prefill.num_handoff_failures + len(prompts)
    assert after.num_recomputed_tokens > 0  # the lost decodes were recomputed here
    assert cache.memory_snapshots + cache.disk_snapshots == 0


async def test_a_decode_instance_back_after_a_long_outage_is_used_at_once(
        tmp_path: Path) -> None:
    """The decode instance is down for 45 s while requests come (each taken
    back after the 5 s --handoff-wait), then back on its address: the next
    request is handed off to it. gRPC's reconnect backoff had grown to ~27 s
    by then (it doubles by 1.6 up to 120 s), so every request for up to two
    minutes after the decode instance came back waited out --handoff-wait
    for its second token and decoded on the prefill instance."""
    prompt = small_prompts(1)[0]
    with running_stack(pd_config(prefill_wait=5), tmp_path) as stack:
        assert stack.decode_scheduler is not None
        stack.decode_scheduler.kill()
        down_until = time.monotonic() + 45
        async with Client(stack.address) as client:
            while time.monotonic() < down_until:
                result = await client.complete(prompt, max_tokens=8, ignore_eos=True)
                assert result.token_ids == reference([prompt], 8)[0]
            taken_back = (await stats(stack.scheduler)).num_handoff_failures
            stack.decode_scheduler = stack.decode_scheduler.restart()
            result = await client.complete(prompt, max_tokens=8, ignore_eos=True)
        prefill = await drained(stack.scheduler)
        decode = await drained(stack.decode_scheduler)
        assert_alive(stack)
    assert result.token_ids == reference([prompt], 8)[0]
    assert prefill.num_handoff_failures == taken_back
    assert decode.num_finished == 1


async def test_a_failed_restore_there_leaves_the_snapshot_to_the_prefill_instance(
        tmp_path: Path) -> None:
    """The decode worker's cache is unreachable (a wrong address), so every
    restore there fails: the decode instance gives each request back,
    leaving the prefill instance's snapshot, which the prefill instance
    decodes from after its hand-offs are spent, recomputing nothing."""
    prompts = small_prompts(3)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{unused.getsockname()[1]}"
    config = dataclasses.replace(pd_config(), cache_arena=False, decode_worker_args=(
        "--cache-address", dead))
    with running_stack(config, tmp_path) as stack:
        outputs = await complete_all(stack.address, prompts)
        prefill = await drained(stack.scheduler)
        decode = await drained(stack.decode_scheduler)
        cache = await cache_stats(stack.cache.address)
        assert_alive(stack)
    assert outputs == reference(prompts)
    assert decode.num_restore_failures >= len(prompts)
    assert decode.num_recomputed_tokens == decode.num_finished == 0
    assert prefill.num_handoffs == prefill.num_handoff_failures == len(prompts)
    assert prefill.num_recomputed_tokens == 0 and prefill.bytes_restored > 0
    assert cache.memory_snapshots + cache.disk_snapshots == 0


async def test_a_snapshot_missing_there_is_taken_back_at_the_first_try(tmp_path: Path) -> None:
    """The decode worker reads another, empty cache: every hand-off's
    snapshot is missing there (NOT_FOUND), as one evicted or expired is.
    Another reservation finds it no more, yet each request was offered to
    decode instances three times (three restores failed there) before the
    prefill instance took it back. Now the first NOT_FOUND gives it back:
    one reservation and one failed restore per request, then decoded on the
    prefill instance from its snapshot."""
    prompts = small_prompts(3)
    empty = start_service("empty-cache", "cache_svc", [
        "--listen", "127.0.0.1:0", "--memory-budget", "64MiB"], tmp_path)
    try:
        config = dataclasses.replace(pd_config(), cache_arena=False, decode_worker_args=(
            "--cache-address", empty.address))
        with running_stack(config, tmp_path) as stack:
            outputs = await complete_all(stack.address, prompts)
            prefill = await drained(stack.scheduler)
            decode = await drained(stack.decode_scheduler)
            assert_alive(stack)
    finally:
        empty.stop()
    assert outputs == reference(prompts)
    assert decode.num_reservations_accepted == decode.num_restore_failures == len(prompts)
    assert decode.num_finished == 0
    assert prefill.num_handoffs == prefill.num_handoff_failures == len(prompts)
    assert prefill.num_recomputed_tokens == 0 and prefill.bytes_restored > 0


async def test_cache_down_means_decoding_on_the_prefill_instance(tmp_path: Path) -> None:
    prompts = small_prompts(4)
    # A reservation (none is made: the copy fails first) would outlive the test.
    config = pd_config(decode=("--reservation-timeout", "600"))
    with running_stack(config, tmp_path) as stack:
        stack.cache.kill()
        outputs = await complete_all(stack.address, prompts)
        prefill = await drained(stack.scheduler)
        decode = await drained(stack.decode_scheduler, timeout_s=10)
        assert_alive(stack, stack.scheduler, stack.decode_scheduler)
    assert outputs == reference(prompts)
    assert prefill.num_handoffs == 0 and prefill.num_handoff_failures == len(prompts)
    assert decode.num_reservations_accepted == 0  # the copy failed first: none asked


async def test_prefill_instance_killed_after_handoff_leaves_nothing_behind(
        tmp_path: Path) -> None:
    prompts = small_prompts(4)
    with running_stack(pd_config(num_blocks=128), tmp_path) as stack:
        work = asyncio.create_task(complete_all(stack.address, prompts, max_tokens=400))
        await until_decoding(stack, 2)
        stack.scheduler.kill()
        await asyncio.gather(work, return_exceptions=True)
        decode = await drained(stack.decode_scheduler)
        cache = await cache_stats(stack.cache.address)
        assert_alive(stack, stack.decode_scheduler, stack.decode_worker, stack.cache)
    # What it took is gone: aborted with the calls (counted as finished by the
    # prefill instance, whose client calls they were), nothing held.
    assert decode.num_reservations_accepted >= 2
    assert decode.num_running_decode == decode.num_reserved == decode.num_offloaded == 0
    assert cache.memory_snapshots + cache.disk_snapshots == 0


async def test_requests_decoding_elsewhere_outlive_the_prefill_worker(tmp_path: Path) -> None:
    """The prefill instance's worker dies while its requests decode on the
    decode instance: they need it no more and finish there, unharmed."""
    prompts = small_prompts(4)
    with running_stack(pd_config(num_blocks=128), tmp_path) as stack:
        work = asyncio.create_task(complete_all(stack.address, prompts, max_tokens=120))
        await until_decoding(stack, len(prompts))
        stack.worker.kill()
        outputs = await work
        prefill = await stats(stack.scheduler)
        assert_alive(stack, stack.scheduler, stack.decode_scheduler, stack.decode_worker)
    assert outputs == reference(prompts, 120)
    assert prefill.num_handoffs == len(prompts) and prefill.num_handoff_failures == 0


async def test_a_decode_instance_without_its_worker_refuses_to_reserve_or_decode(
        tmp_path: Path) -> None:
    """Its worker gone, a decode instance holds no blocks for anyone and
    decodes nothing (it could run neither); the prefill instance decodes
    its requests itself, every one to its reference output."""
    prompts = small_prompts(3)
    with running_stack(pd_config(prefill_wait=0.5), tmp_path) as stack:
        layout = await kv_layout(stack)
        assert stack.decode_worker is not None
        stack.decode_worker.kill()
        channel, stub = decode_stub(stack)
        async with channel:
            deadline = time.monotonic() + 30
            while (answer := await stub.ReserveBlocks(
                    reserve_request("r", [1, 2, 3], layout))).accepted:
                await stub.Abort(scheduler_pb2.AbortRequest(request_id="r"))
                assert time.monotonic() < deadline, "the worker's loss was never seen"
                await asyncio.sleep(0.1)
            assert answer.reason == "its worker is down"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await anext(aiter(stub.Decode(scheduler_pb2.DecodeRequest(
                    request_id="r", snapshot_id="s1", num_tokens=3, first_token_id=1))))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        outputs = await complete_all(stack.address, prompts)
        prefill = await drained(stack.scheduler)
        assert_alive(stack, stack.scheduler, stack.decode_scheduler)
    assert outputs == reference(prompts)
    assert prefill.num_handoffs == prefill.num_handoff_failures == len(prompts)  # taken back


async def test_reservations_that_lapse_at_once_still_end_every_request(tmp_path: Path) -> None:
    """Reservations of 10 ms: one that lapses before its Decode call arrives
    is made again from the same snapshot (or the request is taken back);
    every output is the reference, and nothing stays in the cache."""
    prompts = small_prompts(4)
    config = pd_config(decode=("--reservation-timeout", "0.01"))
    with running_stack(config, tmp_path) as stack:
        outputs = await complete_all(stack.address, prompts)
        prefill = await drained(stack.scheduler)
        decode = await drained(stack.decode_scheduler)
        cache = await cache_stats(stack.cache.address)
        assert_alive(stack)
    assert outputs == reference(prompts)
    assert decode.num_reservations_accepted == (
        decode.num_reservations_expired + prefill.num_handoffs - prefill.num_handoff_failures)
    assert cache.memory_snapshots + cache.disk_snapshots == 0
