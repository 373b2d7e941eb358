from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from cache_svc.config import CacheConfig
from cache_svc.server import CacheServer, create_cache_server
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common.rpc_connections import insecure_channel
from kvstash.common.units import MIB
from kvstash.v1 import cache_pb2_grpc

# The test modules import `cache_helpers` from this folder; tests/ is not a
# package (a tests/cache_svc package would shadow the real cache_svc).
sys.path.insert(0, str(Path(__file__).parent))


@dataclass
class Running:
    cache: CacheServer
    client: CacheClient
    stub: cache_pb2_grpc.KVCacheStub  # for hand-made (malformed) streams
    disk_dir: Path
    channel: grpc.aio.Channel  # the stub's, for calls with raw bytes

    def disk_files(self) -> list[str]:
        return sorted(p.name for p in self.disk_dir.iterdir()) if self.disk_dir.exists() else []

    async def assert_nothing_left(self) -> None:
        stats = await self.client.stats()
        assert stats.reserved_bytes == 0
        assert stats.memory_snapshots == stats.disk_snapshots == 0
        assert stats.memory_bytes == stats.disk_bytes == 0
        assert self.disk_files() == []
        arena = self.cache.store.arena
        assert arena is None or arena.free_bytes == arena.size  # nothing held or quarantined
        self.cache.store.check_integrity()


StartCache = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_cache(tmp_path: Path) -> AsyncIterator[StartCache]:
    """Starts in-process cache servers on port 0; `start_cache(memory_budget_bytes=...)`
    overrides config fields (the disk tier defaults to tmp_path/disk, 64 MiB, so
    a second server started after `stop()` finds the first one's disk tier);
    `clock=` replaces the TTL clock."""
    started: list[tuple[Running, Any]] = []

    async def start(clock: Callable[[], float] = time.monotonic, **overrides: Any) -> Running:
        fields: dict[str, Any] = {
            "memory_budget_bytes": 32 * MIB,
            "disk_dir": tmp_path / "disk",
            "disk_budget_bytes": 64 * MIB,
            # Generous: a put waiting for a spill must not be refused because a
            # loaded machine's fsync is slow. Refusals with nothing running
            # come at once regardless.
            "reserve_wait_s": 30.0,
        }
        fields.update(overrides)
        config = CacheConfig(**fields)
        _server, port, cache = await create_cache_server(config, "127.0.0.1:0", clock)
        address = f"127.0.0.1:{port}"
        channel = insecure_channel(address)
        running = Running(cache, CacheClient(address, chunk_bytes=MIB),
                          cache_pb2_grpc.KVCacheStub(channel), tmp_path / "disk", channel)
        started.append((running, channel))
        return running

    yield start
    for running, channel in started:
        await running.client.close()
        await channel.close()
        await running.cache.stop(0)


@pytest.fixture
def processes() -> Iterator[list[Any]]:
    """Cache processes a test appends here are killed after it, if still running."""
    started: list[Any] = []
    yield started
    for process in started:
        if process.proc.poll() is None:
            process.kill()


FakeCache = Callable[[dict[str, grpc.RpcMethodHandler]], Awaitable[str]]


@pytest.fixture
async def fake_cache() -> AsyncIterator[FakeCache]:
    """Serves KVCache methods from handlers by method name, as a broken or
    hostile cache would answer them; `await fake_cache({...})` is its address."""
    servers: list[grpc.aio.Server] = []

    async def serve(handlers: dict[str, grpc.RpcMethodHandler]) -> str:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("kvstash.v1.KVCache", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield serve
    for server in servers:
        await server.stop(None)
