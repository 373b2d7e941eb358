"""Offload and restore through a real KV cache service, both over real sockets:
through the cache's shared-memory arena (the co-located path) and streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from cache_svc.config import CacheConfig
from cache_svc.server import create_cache_server
from gpu_worker.config import WorkerConfig
from gpu_worker.runner import SeqWork
from gpu_worker.server import create_worker_server
from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common import rpc_server
from kvstash.common.rpc_connections import insecure_channel
from kvstash.common.units import MIB
from kvstash.launch.processes import start_service
from kvstash.v1 import cache_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler_svc.core.outputs import OffloadCommand
from scheduler_svc.worker_link import WorkerLink
from tests.gpu_worker.test_worker_server import run_steps
from tests.gpu_worker.worker_factories import blocks_for, greedy_generate, make_runner, prompt


@dataclass
class Services:
    stub: worker_pb2_grpc.WorkerStub
    link: WorkerLink  # the scheduler's side of the same worker
    cache: CacheClient  # straight to the cache service, to look at what the worker left
    shared: bool  # the cache has an arena the worker maps


@pytest.fixture(params=["arena", "streamed"])
async def services(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Services]:
    shared = request.param == "arena"
    _, cache_port, cache = await create_cache_server(
        CacheConfig(memory_budget_bytes=16 * MIB, arena_dir=tmp_path if shared else None),
        "127.0.0.1:0")
    config = WorkerConfig(block_size=4, num_blocks=64, cache_address=f"127.0.0.1:{cache_port}",
                          cache_timeout_s=10.0)
    worker = await create_worker_server(config, "127.0.0.1:0", runner=make_runner())
    channel = insecure_channel(f"127.0.0.1:{worker.port}")
    client = CacheClient(f"127.0.0.1:{cache_port}")
    yield Services(worker_pb2_grpc.WorkerStub(channel), WorkerLink(channel), client, shared)
    await client.close()
    await channel.close()
    await worker.server.stop(None)
    await worker.servicer.close()
    await cache.stop(None)


async def test_offloaded_request_resumes_with_identical_tokens(services: Services) -> None:
    stub = services.stub
    ids = prompt("Preempt me after a few tokens, please.")
    expected = greedy_generate(make_runner(), ids, 16, blocks_for(len(ids) + 16))
    old, new = blocks_for(len(ids) + 16, 0), blocks_for(len(ids) + 16, 20)[::-1]
    steps = [[SeqWork("a", ids, 0, old, True)]]
    out = [(await run_steps(stub, steps))[0][0][1]]
    for _ in range(5):
        pos = len(ids) + len(out) - 1
        out.append((await run_steps(stub, [[SeqWork("a", [out[-1]], pos, old, True)]]))[0][0][1])
    num_tokens = len(ids) + len(out) - 1  # the last sampled token has no KV yet
    used = old[: -(-num_tokens // 4)]
    off = await stub.Offload(worker_pb2.OffloadRequest(
        request_id="a", snapshot_id="req-a", block_ids=used, num_tokens=num_tokens))
    assert off.num_bytes == len(used) * 8192
    # Kept by the cache's own admission policy, which nobody relayed: pinned,
    # expiring after the cache's default TTL.
    header = (await services.cache.stat("req-a")).header
    assert header.pinned and header.ttl_s == CacheConfig().default_ttl_s
    # Someone else's step overwrites the old blocks before the request resumes.
    await run_steps(stub, [[SeqWork("intruder", [7] * len(used) * 4, 0, used)]])
    restored = await stub.Restore(worker_pb2.RestoreRequest(
        request_id="a", snapshot_id="req-a", block_ids=new[: len(used)]))
    assert restored.num_bytes == off.num_bytes
    # The restore consumed the snapshot: gone, and its memory given back.
    with pytest.raises(errors.NotFound):
        await services.cache.stat("req-a")
    stats = await services.cache.stats()
    assert (stats.num_consumed, stats.memory_bytes, stats.pinned_bytes) == (1, 0, 0)
    # The bytes took the co-located path when there was one, both ways.
    shared = int(services.shared)
    assert (stats.num_puts, stats.num_shared_puts, stats.num_shared_gets) == (1, shared, shared)
    while len(out) < 16:
        pos = len(ids) + len(out) - 1
        out.append((await run_steps(stub, [[SeqWork("a", [out[-1]], pos, new, True)]]))[0][0][1])
    assert out == expected


async def test_a_prefix_segment_is_kept_unpinned_read_without_consuming_and_sent_once(
        services: Services) -> None:
    stub = services.stub
    ids = prompt("A system prompt every conversation starts with.")[:16]
    await run_steps(stub, [[SeqWork("a", ids, 0, [0, 1, 2, 3])]])
    save = worker_pb2.OffloadRequest(request_id="a", snapshot_id="pfx-0123", block_ids=[0, 1],
                                     num_tokens=8, shared_prefix=True)
    assert (await stub.Offload(save)).num_bytes == 2 * 8192
    assert not (await services.cache.stat("pfx-0123")).header.pinned  # evictable
    assert (await stub.Offload(save)).num_bytes == 0  # already stored: a success
    # Two readers, into other blocks; the segment stays for the next.
    for target in ([10, 11], [20, 21]):
        read = worker_pb2.RestoreRequest(request_id="b", snapshot_id="pfx-0123",
                                         block_ids=target, keep=True)
        assert (await stub.Restore(read)).num_bytes == 2 * 8192
    assert (await services.cache.stats()).num_consumed == 0
    # The blocks read back hold what the prefill wrote: decoding from either
    # table gives the same tokens as from the original.
    tokens = []
    for table in ([0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]):
        if table[2] != 2:
            await run_steps(stub, [[SeqWork("b", ids[8:], 8, table)]])
        tokens.append((await run_steps(stub, [[SeqWork("b", ids[-1:], 15, table, True)]]))[0])
    assert tokens[0] == tokens[1] == tokens[2]


async def test_cache_side_errors_keep_their_codes(services: Services) -> None:
    stub = services.stub
    request = worker_pb2.OffloadRequest(request_id="r", snapshot_id="dup", block_ids=[0, 1],
                                        num_tokens=8)
    await stub.Offload(request)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Offload(request)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Restore(worker_pb2.RestoreRequest(request_id="r", snapshot_id="missing",
                                                     block_ids=[3]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Offload(worker_pb2.OffloadRequest(request_id="r", snapshot_id="../etc",
                                                     block_ids=[0], num_tokens=1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_refused_offload_stored_nothing_so_nothing_is_deleted(services: Services) -> None:
    """A failure's meaning is read once, by the scheduler's WorkerLink, from the
    status the worker passes on unchanged: a put the cache refused (here, the id
    is taken) or the worker rejected stored nothing, and the snapshot already
    under that id is not someone the scheduler may delete."""
    link = services.link
    stored = await link.offload(OffloadCommand("r", "dup", [0, 1], 8), timeout_s=10)
    assert stored.num_bytes == 2 * 8192 and not stored.maybe_stored
    taken = await link.offload(OffloadCommand("r", "dup", [2, 3], 8), timeout_s=10)
    assert taken.num_bytes is None and not taken.maybe_stored
    assert taken.error.startswith("ALREADY_EXISTS")
    rejected = await link.offload(OffloadCommand("r", "big", [0, 1], 9), timeout_s=10)
    assert rejected.num_bytes is None and not rejected.maybe_stored
    assert rejected.error.startswith("INVALID_ARGUMENT")
    assert (await services.cache.stat("dup")).header.num_blocks == 2


class StalledCache(cache_pb2_grpc.KVCacheServicer):
    """Takes puts and never answers them; records the deadline each one had."""

    def __init__(self) -> None:
        self.time_remaining: list[float | None] = []

    async def PutSnapshot(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        self.time_remaining.append(context.time_remaining())
        await asyncio.sleep(3600)


async def test_a_stalled_cache_fails_the_offload_at_the_callers_deadline() -> None:
    stalled = StalledCache()
    cache_server, cache_port, _ = await rpc_server.create_server(
        "127.0.0.1:0", [lambda s: cache_pb2_grpc.add_KVCacheServicer_to_server(stalled, s)], [])
    config = WorkerConfig(block_size=4, num_blocks=64, cache_address=f"127.0.0.1:{cache_port}",
                          cache_timeout_s=30.0)
    worker = await create_worker_server(config, "127.0.0.1:0", runner=make_runner())
    loop = asyncio.get_running_loop()
    try:
        async with insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            started = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Offload(worker_pb2.OffloadRequest(
                    request_id="r", snapshot_id="s", block_ids=[0], num_tokens=1), timeout=1.0)
            elapsed = loop.time() - started
        assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                     grpc.StatusCode.UNAVAILABLE)
        assert elapsed < 5.0
        # The cache was told the caller's deadline, not the worker's 30 s.
        [remaining] = stalled.time_remaining
        assert remaining is not None and remaining < 1.5
        # No answer in time: the snapshot may have been committed after all,
        # so the scheduler's link says to delete it.
        async with insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            outcome = await WorkerLink(channel).offload(OffloadCommand("r", "s2", [0], 1), 1.0)
        assert outcome.num_bytes is None and outcome.maybe_stored
    finally:
        await worker.server.stop(None)
        await worker.servicer.close()
        await cache_server.stop(None)


async def test_a_worker_keeps_offloading_across_a_cache_restart(tmp_path: Path) -> None:
    """The cache process is SIGKILLed and restarted with a new arena while the
    worker keeps the old one mapped: its next offload is refused through the
    old arena before any room is taken (FAILED_PRECONDITION), and its
    fallback put maps the new arena and goes through it; no call ends twice
    in the cache. Before: the cache handed out an extent of its new arena, the
    worker cancelled, and the cache aborted that call a second time ("Abort
    already called!" in its log)."""
    cache = start_service("cache", "cache_svc", [
        "--listen", "127.0.0.1:0", "--memory-budget", "16MiB", "--arena-dir",
        str(tmp_path / "arena")], tmp_path)
    worker = None
    try:
        config = WorkerConfig(block_size=4, num_blocks=64, cache_address=cache.address,
                              cache_timeout_s=10.0)
        worker = await create_worker_server(config, "127.0.0.1:0", runner=make_runner())
        async with insecure_channel(f"127.0.0.1:{worker.port}") as channel, \
                CacheClient(cache.address) as observer:
            stub = worker_pb2_grpc.WorkerStub(channel)

            async def offload(snapshot_id: str) -> int:
                reply = await stub.Offload(worker_pb2.OffloadRequest(
                    request_id="r", snapshot_id=snapshot_id, block_ids=[0, 1], num_tokens=8))
                return reply.num_bytes

            assert await offload("before") == 2 * 8192
            assert (await observer.stats()).num_shared_puts == 1
            cache.kill()
            cache = cache.restart()
            assert await offload("after") == 2 * 8192
            assert await offload("re-attached") == 2 * 8192
            stats = await observer.stats()
            assert (stats.num_puts, stats.num_shared_puts) == (2, 2)
            restored = await stub.Restore(worker_pb2.RestoreRequest(
                request_id="r", snapshot_id="re-attached", block_ids=[4, 5]))
            assert restored.num_bytes == 2 * 8192
    finally:
        if worker is not None:
            await worker.server.stop(None)
            await worker.servicer.close()
        cache.stop()
    log = cache.log_path.read_text()
    assert "Abort already called" not in log and "Traceback" not in log, log
