"""A client that keeps the cache's arena mapped across a restart of the
cache (as a worker does): every shared call it makes ends once, with a
specific status, and the client re-attaches to the new arena.

Before: the cache handed the stale client an extent of its new arena, the
client cancelled, the cache's refusal could not be sent and was aborted a
second time ("Abort already called!" in the cache's log, UNKNOWN for a
caller still listening)."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
from cache_helpers import (
    make_header,
    make_layout,
    make_payload,
    start_cache_process,
    wait_until,
)

from kvstash.cache_sdk import arena_calls
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.cache_sdk.shared_arena import ARENA_ID_KEY
from kvstash.common.rpc_connections import insecure_channel
from kvstash.v1 import cache_pb2, cache_pb2_grpc

LAYOUT = make_layout("bfloat16")  # 32 KiB blocks


async def test_a_client_mapping_the_old_arena_is_refused_once_and_re_attaches(
        tmp_path: Path, processes: list[object]) -> None:
    log = tmp_path / "cache.log"
    args = ("--memory-budget", "8MiB", "--arena-dir", str(tmp_path / "arena"))
    first = start_cache_process(*args, log=log)
    processes.append(first)
    data = make_payload(LAYOUT, 16)
    async with CacheClient(first.address) as worker:  # one client, as a worker keeps
        await worker.put("a", LAYOUT, 16, 256, data)
        old = await worker.arena()
        assert old is not None
        first.kill()
        second = start_cache_process(*args, "--listen", first.address, log=log)
        processes.append(second)

        async with insecure_channel(second.address) as channel:
            stub = cache_pb2_grpc.KVCacheStub(channel)
            new_id = (await stub.GetArena(cache_pb2.GetArenaRequest())).arena_id
            assert new_id != old.arena_id
            stale = ((ARENA_ID_KEY, old.arena_id),)
            # A caller that names the arena it maps and stays to listen.
            put = stub.PutShared(metadata=stale, timeout=30)
            await put.write(cache_pb2.PutSharedRequest(
                header=make_header("b", LAYOUT, 16)))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await put.read()
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"maps arena '{old.arena_id}', this cache's is {new_id}" in (
                caught.value.details() or "")
            assert "re-attach" in (caught.value.details() or "")
            get = stub.GetShared(metadata=stale, timeout=30)
            await get.write(cache_pb2.GetSharedRequest(
                open=cache_pb2.GetSnapshotRequest(snapshot_id="b")))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await get.read()
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # A caller that names no arena gets an extent of the new one and
            # leaves, as CacheClient did before it named its arena.
            put = stub.PutShared(timeout=30)
            await put.write(cache_pb2.PutSharedRequest(
                header=make_header("c", LAYOUT, 16)))
            assert (await put.read()).extent.arena_id == new_id
            put.cancel()

            async def extent_back() -> bool:
                stats = await worker.stats()
                return stats.reserved_bytes == 0 and stats.num_failed_puts == 1

            await wait_until(extent_back, "the cancelled put ended (its extent quarantined)")

        # The worker's client, still mapping the old arena: this put is
        # refused through the arena and streamed; the next one re-attached.
        for name in ("d", "e"):
            await worker.put(name, LAYOUT, 16, 256, data)
        assert (await worker.arena()) is not None
        assert (await worker.arena()).arena_id == new_id
        stats = await worker.stats()
        assert (stats.num_puts, stats.num_shared_puts) == (2, 1)
        for name in ("d", "e"):
            out = np.zeros_like(data)
            await worker.get_into(name, memoryview(out))
            assert out.tobytes() == data.tobytes()
    assert second.terminate() == 0
    text = log.read_text()
    assert "Abort already called" not in text
    assert "Unexpected" not in text and "Traceback" not in text, text


async def test_a_client_that_found_no_arena_maps_the_one_of_a_cache_restarted_with_one(
        tmp_path: Path, processes: list[object], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a client that first found the cache without an arena never
    asked again, so it streamed to the restarted cache's arena until its
    process restarted."""
    monkeypatch.setattr(arena_calls, "_REMAP_AFTER_S", 1.0)
    first = start_cache_process("--memory-budget", "8MiB")
    processes.append(first)
    data = make_payload(LAYOUT, 16)
    async with CacheClient(first.address) as worker:
        await worker.put("a", LAYOUT, 16, 256, data)
        assert await worker.arena() is None  # streamed
        first.kill()
        second = start_cache_process("--memory-budget", "8MiB", "--arena-dir",
                                     str(tmp_path / "arena"), "--listen", first.address)
        processes.append(second)

        async def mapped() -> bool:
            return await worker.arena() is not None

        await wait_until(mapped, "the client mapped the new cache's arena")
        await worker.put("b", LAYOUT, 16, 256, data)
        stats = await worker.stats()
        assert (stats.num_puts, stats.num_shared_puts) == (1, 1)
        out = np.zeros_like(data)
        await worker.get_into("b", memoryview(out))
        assert out.tobytes() == data.tobytes()
    assert second.terminate() == 0
