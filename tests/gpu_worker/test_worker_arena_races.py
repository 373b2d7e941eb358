"""The worker's arena copies when the cache ends their calls under them: a
gather queued behind a long step past its lease does not write the extent
(by then another put's), and a cache gone mid-copy fails the copy as
UNAVAILABLE (the scheduler falls back), not INTERNAL; a copy whose caller
timed out while it waited does not commit. Real gRPC, an in-process cache
with its shared-memory arena."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from cache_svc.config import CacheConfig
from cache_svc.server import create_cache_server
from gpu_worker.config import WorkerConfig
from gpu_worker.runner import ModelRunner
from gpu_worker.server import WorkerServer, create_worker_server
from kvstash.cache_sdk.arena_calls import _to_the_end
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common.rpc_connections import insecure_channel
from kvstash.common.units import MIB
from kvstash.v1 import cache_pb2, worker_pb2, worker_pb2_grpc
from tests.gpu_worker.worker_factories import MemoryCache, make_runner


@dataclass
class Stack:
    runner: ModelRunner
    worker: WorkerServer
    stub: worker_pb2_grpc.WorkerStub
    client: CacheClient  # straight to the cache, an observer / another writer
    cache_server: grpc.aio.Server
    channel: Any

    def block_compute(self) -> threading.Event:
        """Occupies the worker's compute thread (as a long step would) until set."""
        release = threading.Event()
        self.worker.servicer._compute.submit(release.wait, 30)
        return release

    async def stop(self) -> None:
        await self.client.close()
        await self.channel.close()
        await self.worker.server.stop(None)
        await self.worker.servicer.close()
        await self.cache_server.stop(None)


async def _start(tmp_path: Path, shared: bool, dtype: torch.dtype = torch.float32,
                 num_blocks: int = 64, **cache_kw: Any) -> Stack:
    cache_server, cache_port, _ = await create_cache_server(
        CacheConfig(memory_budget_bytes=64 * MIB,
                    arena_dir=tmp_path / "arena" if shared else None, **cache_kw),
        "127.0.0.1:0")
    config = WorkerConfig(block_size=4, num_blocks=num_blocks,
                          cache_address=f"127.0.0.1:{cache_port}", cache_timeout_s=20.0)
    runner = make_runner(dtype, num_blocks=num_blocks)
    worker = await create_worker_server(config, "127.0.0.1:0", runner=runner)
    channel = insecure_channel(f"127.0.0.1:{worker.port}")
    return Stack(runner, worker, worker_pb2_grpc.WorkerStub(channel),
                 CacheClient(f"127.0.0.1:{cache_port}"), cache_server, channel)


async def test_a_gather_queued_past_the_lease_does_not_write_another_snapshots_extent(
        tmp_path: Path) -> None:
    """An arena offload waits for its gather behind a long step; the cache
    ends the put when its lease runs out and, after the quarantine, hands the
    same extent to another put. The gather, its turn come, sees the call
    ended and writes nothing (it overwrote the other, committed, snapshot:
    DATA_LOSS at its restore)."""
    s = await _start(tmp_path, True, shared_lease_s=0.4)
    try:
        s.runner.kv_cache.fill_(1.0)
        release = s.block_compute()
        offload = asyncio.ensure_future(s.stub.Offload(worker_pb2.OffloadRequest(
            request_id="r", snapshot_id="late", block_ids=[0, 1], num_tokens=8), timeout=15))
        await asyncio.sleep(1.5)  # lease (0.4 s) and quarantine (0.4 s) are over
        other = (np.arange(2 * s.runner.host_pool.block_bytes) % 251).astype(np.uint8)
        assert await s.client.put("other", s.runner.layout, 2, 8, other.tobytes(),
                                  timeout_s=5) == other.nbytes
        assert (await s.client.stats()).num_shared_puts == 1  # through the arena
        release.set()
        with pytest.raises(grpc.aio.AioRpcError):
            await offload
        _, data = await s.client.get("other", timeout_s=5)  # DataLoss if overwritten
        assert data == other.tobytes()
    finally:
        await s.stop()


@pytest.mark.parametrize("copy", ["offload", "restore"])
async def test_a_cache_gone_mid_arena_copy_fails_unavailable(tmp_path: Path, copy: str) -> None:
    """The cache goes away while the gather (or scatter) into its extent waits
    for the compute thread: the copy fails as the cache unreachable
    (UNAVAILABLE), not as a worker bug (INTERNAL: grpc's InvalidStateError
    'RPC already finished' on the call's next write)."""
    s = await _start(tmp_path, True)
    try:
        if copy == "restore":
            await s.stub.Offload(worker_pb2.OffloadRequest(
                request_id="r", snapshot_id="s", block_ids=[0, 1], num_tokens=8))
            call = s.stub.Restore(worker_pb2.RestoreRequest(
                request_id="r", snapshot_id="s", block_ids=[4, 5]), timeout=15)
        else:
            call = s.stub.Offload(worker_pb2.OffloadRequest(
                request_id="r", snapshot_id="t", block_ids=[2, 3], num_tokens=8), timeout=15)
        release = s.block_compute()
        pending = asyncio.ensure_future(call)
        await asyncio.sleep(0.5)  # the extent is handed out; the copy waits
        await s.cache_server.stop(None)  # the cache process is gone
        release.set()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pending
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    finally:
        await s.stop()


class ThreadCopyCache(MemoryCache):
    """get_into as CacheClient's arena path makes it: the bytes copied on a
    thread (`_to_the_end` lets it finish), here once the test says go."""

    def __init__(self) -> None:
        super().__init__()
        self.go, self.copied = threading.Event(), threading.Event()

    async def get_into(self, snapshot_id: str, out: memoryview, start_chunk: int = 0,
                       consume: bool = False,
                       timeout_s: float | None = None) -> cache_pb2.SnapshotHeader:
        header, _ = self.snapshots[snapshot_id]

        def copy() -> None:
            self.go.wait(10)
            out[:] = b"\xab" * out.nbytes
            self.copied.set()

        await _to_the_end(asyncio.to_thread(copy))
        return header


async def test_a_restore_keeps_its_buffer_until_the_cache_copy_into_it_ends() -> None:
    """The restore's deadline passes mid-copy: its timeout cancels the get,
    then gRPC cancels the handler for the same deadline. Under `wait_for`
    that second cancel stopped the wait for the get, the buffer went back to
    the pool, and the copy went on writing into what the pool lent next."""
    runner, cache = make_runner(num_blocks=8), ThreadCopyCache()
    worker = await create_worker_server(WorkerConfig(block_size=4, num_blocks=8),
                                        "127.0.0.1:0", runner, cache)
    try:
        async with insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            await stub.Offload(worker_pb2.OffloadRequest(
                request_id="r", snapshot_id="s", block_ids=[0], num_tokens=4))
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Restore(worker_pb2.RestoreRequest(
                    request_id="r", snapshot_id="s", block_ids=[1]), timeout=0.3)
            await asyncio.sleep(0.3)
            assert not cache.copied.is_set() and runner.host_pool.num_lent == 1
            cache.go.set()
            async with asyncio.timeout(10):
                while runner.host_pool.num_lent:
                    await asyncio.sleep(0.01)
            assert cache.copied.is_set()
    finally:
        cache.go.set()
        await worker.server.stop(None)
        await worker.servicer.close()


class SlowLink:
    """A TCP proxy to 127.0.0.1:`port` that passes on each byte from its
    clients `delay_s` late, as a slow network would: a call arrives late, and
    so does the cancellation its caller sends at its deadline."""

    def __init__(self, port: int, delay_s: float) -> None:
        self._port, self._delay_s = port, delay_s
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._port)
        loop = asyncio.get_running_loop()
        late: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def take() -> None:
            while data := await reader.read(65536):
                late.put_nowait((loop.time() + self._delay_s, data))

        async def send_late() -> None:
            while True:
                due, data = await late.get()
                await asyncio.sleep(due - loop.time())
                up_writer.write(data)
                await up_writer.drain()

        async def answer() -> None:
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()

        try:
            await asyncio.gather(take(), send_late(), answer())
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            up_writer.close()


@pytest.mark.parametrize("copy", ["offload", "restore"])
async def test_a_copy_the_caller_saw_time_out_does_not_commit(tmp_path: Path, copy: str) -> None:
    """The call reaches the worker 0.15 s late, so its deadline there ends
    0.15 s after the caller's, and so does the cancellation the caller sends.
    The copy waits for the compute thread (a long step) past the caller's
    deadline, then runs. Before: in that gap it committed, a restore
    consuming the snapshot (a hand-in given back found the prefill side's
    snapshot gone), an offload storing one after its caller's delete.
    Now the worker's deadline ends a margin (5%, 0.4 s here) before."""
    s = await _start(tmp_path, True)
    link = SlowLink(s.worker.port, delay_s=0.15)
    try:
        await s.stub.Offload(worker_pb2.OffloadRequest(
            request_id="r", snapshot_id="s", block_ids=[0, 1], num_tokens=8))
        async with insecure_channel(f"127.0.0.1:{await link.start()}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=30)  # connected
            release = s.block_compute()
            if copy == "restore":
                call = stub.Restore(worker_pb2.RestoreRequest(
                    request_id="r", snapshot_id="s", block_ids=[4, 5]), timeout=8)
            else:
                call = stub.Offload(worker_pb2.OffloadRequest(
                    request_id="r", snapshot_id="t", block_ids=[2, 3], num_tokens=8), timeout=8)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            release.set()  # the caller has seen it fail: the copy may run now
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.get_running_loop().run_in_executor(s.worker.servicer._compute,
                                                             lambda: None)
            await asyncio.sleep(1.0)  # past the cancellation's arrival; a commit has landed
        stats = await s.client.stats()
        assert stats.num_consumed == 0
        assert await s.client.find(["s", "t"]) == [cache_pb2.TIER_MEMORY,
                                                   cache_pb2.TIER_UNSPECIFIED]
    finally:
        await link.close()
        await s.stop()
