"""The co-located path: the memory tier in a shared-memory arena that clients
map (cache_svc.arena, cache.proto PutShared/GetShared, kvstash.cache_sdk.shared_arena)."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import sys
import textwrap
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from cache_helpers import (
    MIB,
    REPO,
    bytes_per_block,
    make_header,
    make_layout,
    make_payload,
    start_cache_process,
    wait_until,
)

from cache_svc.arena import ALIGN, Arena, remove_stale
from kvstash import errors
from kvstash.cache_sdk import arena_calls
from kvstash.cache_sdk.arena_calls import Lease, Write
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.cache_sdk.chunk_codec import checksum
from kvstash.cache_sdk.shared_arena import (
    SharedArena,
    arena_file_name,
    copy_hashed,
    copy_verified,
)
from kvstash.v1 import cache_pb2

LAYOUT = make_layout("bfloat16")  # 32 KiB blocks
BLOCK = bytes_per_block(LAYOUT)


# -- the allocator ---------------------------------------------------------------


def test_extents_are_best_fit_and_freed_ranges_merge(tmp_path) -> None:
    arena = Arena(tmp_path, 64 * ALIGN)
    a, b, c = (arena.alloc(n * ALIGN) for n in (8, 4, 16))
    assert a is not None and b is not None and c is not None
    assert [arena.offset_of(x) for x in (a, b, c)] == [0, 8 * ALIGN, 12 * ALIGN]
    arena.free(a)  # free: [0, 8) and [28, 64)
    small = arena.alloc(5 * ALIGN + 1)  # best fit: the 8-unit hole, not the 36-unit tail
    assert small is not None and arena.offset_of(small) == 0
    arena.free(small)
    arena.free(c)
    arena.free(b)  # everything merges back into one range
    assert (arena.free_bytes, arena.largest_free()) == (64 * ALIGN, 64 * ALIGN)
    arena.check_integrity(0)
    with pytest.raises(ValueError, match="already free"):
        arena.free(b)
    arena.close()
    assert not arena.path.exists()


def test_fragmented_arena_refuses_what_no_single_range_holds(tmp_path) -> None:
    arena = Arena(tmp_path, 12 * ALIGN)
    pieces = [arena.alloc(4 * ALIGN) for _ in range(3)]
    assert all(p is not None for p in pieces)
    arena.free(pieces[0])  # type: ignore[arg-type]
    arena.free(pieces[2])  # type: ignore[arg-type]
    assert arena.free_bytes == 8 * ALIGN
    assert arena.alloc(5 * ALIGN) is None  # 8 units free, in two pieces of 4
    # What freeing the middle piece would make: one range of all 12 units.
    assert arena.largest_free() == 4 * ALIGN
    assert arena.largest_free([pieces[1]]) == 12 * ALIGN  # type: ignore[list-item]
    assert arena.alloc(4 * ALIGN) is not None
    assert arena.largest_free([pieces[1]]) == 8 * ALIGN  # type: ignore[list-item]
    arena.close()


def test_stale_arenas_are_removed_live_ones_kept(tmp_path) -> None:
    live = Arena(tmp_path, 16 * ALIGN)
    stale = tmp_path / "kvstash-arena-0123456789abcdef.shm"  # its cache died
    stale.write_bytes(b"\0" * ALIGN)
    assert remove_stale(tmp_path) == 1
    assert not stale.exists() and live.path.exists()
    # The lock is what marks a live arena: it is held.
    fd = os.open(live.path, os.O_RDONLY)
    with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    live.close()


def test_an_arena_that_does_not_fit_fails_the_start_clearly() -> None:
    shm = Path("/dev/shm")
    fs = os.statvfs(shm)
    too_big = fs.f_blocks * fs.f_frsize + 1024 * MIB  # more than the tmpfs can ever hold
    before = set(os.listdir(shm))
    with pytest.raises(OSError, match=r"cannot allocate a \d+-byte arena in /dev/shm"):
        Arena(shm, too_big)
    # Nothing left behind (other caches' arenas may come and go meanwhile).
    assert not set(os.listdir(shm)) - before


def test_copies_hash_every_chunk_in_order_and_verify_what_landed() -> None:
    src = np.random.default_rng(3).integers(0, 256, 5 * MIB + 123, dtype=np.uint8)
    want = [checksum(src[start : start + MIB]) for start in range(0, src.nbytes, MIB)]
    for source in (memoryview(src), memoryview(src.tobytes())):  # writable, and read-only
        dst = np.zeros_like(src)
        assert copy_hashed(memoryview(dst), source, MIB) == want
        assert np.array_equal(dst, src)
    out = np.zeros_like(src)
    copy_verified(memoryview(out), memoryview(src), MIB, want, "s")
    assert np.array_equal(out, src)
    bad = [*want[:4], want[4] ^ 1, want[5]]
    with pytest.raises(errors.DataLoss, match="s: chunk 4 hashes to"):
        copy_verified(memoryview(out), memoryview(src), MIB, bad, "s")
    with pytest.raises(errors.DataLoss, match="5 checksums"):
        copy_verified(memoryview(out), memoryview(src), MIB, want[:5], "s")
    with pytest.raises(ValueError, match="into"):
        copy_hashed(memoryview(dst[:-1]), memoryview(src), MIB)


# -- the co-located path, in process ------------------------------------------------


async def test_shared_put_and_get_round_trip_byte_identical(start_cache, tmp_path) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena")
    data = make_payload(LAYOUT, 40)
    client = running.client
    assert await client.arena() is not None
    stored = await client.put("s", LAYOUT, 40, 600, data)
    out = np.zeros_like(data)
    header = await client.get_into("s", memoryview(out))
    assert stored == data.nbytes and out.tobytes() == data.tobytes()
    assert (header.num_blocks, header.num_tokens) == (40, 600)
    stats = await client.stats()
    assert (stats.num_shared_puts, stats.num_shared_gets) == (1, 1)
    assert (stats.bytes_in, stats.bytes_out) == (data.nbytes, data.nbytes)
    # The same bytes stream out over gRPC, with the checksums the writer sent.
    async with CacheClient(client.address, chunk_bytes=MIB, use_arena=False) as streaming:
        _, streamed = await streaming.get("s")
    assert streamed == data.tobytes()
    running.cache.store.check_integrity()


async def test_streamed_put_is_read_through_the_arena(start_cache, tmp_path) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena")
    data = make_payload(LAYOUT, 10, seed=3)
    async with CacheClient(running.client.address, chunk_bytes=MIB, use_arena=False) as streaming:
        await streaming.put("s", LAYOUT, 10, 160, data)
    out = np.zeros_like(data)
    await running.client.get_into("s", memoryview(out), consume=True)
    assert out.tobytes() == data.tobytes()
    stats = await running.client.stats()
    assert (stats.num_shared_puts, stats.num_shared_gets, stats.num_consumed) == (0, 1, 1)
    await running.assert_nothing_left()


async def test_consume_waits_for_done(start_cache, tmp_path) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena")
    data = make_payload(LAYOUT, 4)
    await running.client.put("s", LAYOUT, 4, 64, data)

    async def refuse(header: cache_pb2.SnapshotHeader, extent: memoryview,
                     checksums: list[int]) -> None:
        raise errors.InvalidArgument("not the layout I wanted")

    with pytest.raises(errors.InvalidArgument):
        await running.client.get_shared("s", refuse, consume=True)
    await wait_until(lambda: running.cache.store.stats().num_gets == 1, "the get ended")
    assert (await running.client.stat("s")).tier == cache_pb2.TIER_MEMORY  # still there

    seen: list[bytes] = []

    async def keep(header: cache_pb2.SnapshotHeader, extent: memoryview,
                   checksums: list[int]) -> None:
        seen.append(bytes(extent))

    assert await running.client.get_shared("s", keep, consume=True) is not None
    assert seen == [data.tobytes()]
    with pytest.raises(errors.NotFound):
        await running.client.stat("s")
    await running.assert_nothing_left()


async def test_a_cancelled_put_ends_only_once_its_write_has(start_cache, tmp_path) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena")
    writes: list[str] = []

    def slow_write(extent: memoryview) -> None:  # a copy on a thread cannot be stopped
        writes.append("started")
        time.sleep(0.5)
        extent[:] = bytes(extent.nbytes)
        writes.append("done")

    async def write(extent: memoryview, lease: Lease) -> None:
        await asyncio.to_thread(slow_write, extent)

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(running.client.put_shared(
            "s", LAYOUT, 4, 64, 4 * BLOCK, write), 0.1)
    assert writes == ["started", "done"]  # the lease outlived the write
    await wait_until(lambda: running.cache.store.stats().reserved_bytes == 0,
                     "the extent went back")
    await running.assert_nothing_left()  # abandoned: back at once, not quarantined


def slow_writer(seconds: float) -> tuple[list[str], Write]:
    """A put's filler that copies on a thread for `seconds`, and what it did."""
    writes: list[str] = []

    def slow_write(extent: memoryview) -> None:
        writes.append("started")
        time.sleep(seconds)
        extent[:] = bytes(extent.nbytes)
        writes.append("done")

    async def write(extent: memoryview, lease: Lease) -> None:
        await asyncio.to_thread(slow_write, extent)

    return writes, write


async def test_a_put_cancelled_twice_keeps_its_extent_until_its_write_ends(
        start_cache, tmp_path) -> None:
    """A second cancel (the worker's deadline, then its Offload's own
    cancellation) still waits for the write: the call ends only then, and
    its extent goes back at once. Before, the second cancel ended the call
    mid-write and another put could get the extent under the copy."""
    running = await start_cache(arena_dir=tmp_path / "arena")
    arena = running.cache.store.arena
    writes, write = slow_writer(1.0)
    put = asyncio.create_task(running.client.put_shared("s", LAYOUT, 4, 64, 4 * BLOCK, write))
    await wait_until(lambda: writes == ["started"], "the write began")
    put.cancel()
    await asyncio.sleep(0.1)
    put.cancel()
    while writes == ["started"]:
        assert not put.done() and arena.free_bytes < arena.size, "the put ended mid-write"
        await asyncio.sleep(0.01)
    with pytest.raises(asyncio.CancelledError):
        await put
    await running.assert_nothing_left()


async def test_closing_the_client_mid_copy_keeps_the_extent_until_the_copy_ends(
        start_cache, tmp_path) -> None:
    """Closing a client cancels its calls, a put whose copy still runs
    included: the cache cannot tell that from a writer cut off, and
    quarantines the extent for a lease before another put gets it. Before,
    a cancelled call gave it back at once."""
    running = await start_cache(arena_dir=tmp_path / "arena", shared_lease_s=2.0)
    arena = running.cache.store.arena
    client = CacheClient(running.client.address, chunk_bytes=MIB)
    writes, write = slow_writer(1.0)
    put = asyncio.create_task(client.put_shared("s", LAYOUT, 4, 64, 4 * BLOCK, write))
    await wait_until(lambda: writes == ["started"], "the write began")
    await client.close()
    while writes == ["started"]:
        assert arena.free_bytes < arena.size, "the extent went back mid-copy"
        await asyncio.sleep(0.01)
    with pytest.raises(errors.Unavailable):
        await put
    await wait_until(lambda: arena.free_bytes == arena.size, "the quarantine ended")
    await running.assert_nothing_left()


def _serve_arena(info: cache_pb2.ArenaInfo) -> dict[str, grpc.RpcMethodHandler]:
    return {"GetArena": grpc.unary_unary_rpc_method_handler(
        lambda request, context: info, response_serializer=cache_pb2.ArenaInfo.SerializeToString)}


@pytest.mark.parametrize("named", ["arena file", "any file", "arena-named link"])
async def test_client_maps_only_a_cache_arena_file(fake_cache, tmp_path, named) -> None:
    """The client maps read-write, and puts write into, whatever file
    GetArena names: only a regular file named as the cache names its arena
    is mapped (not any file of the right size, not a link), else it streams."""
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"A" * ALIGN)
    path = {"arena file": tmp_path / arena_file_name("x"), "any file": victim,
            "arena-named link": tmp_path / arena_file_name("x")}[named]
    if named == "arena file":
        path.write_bytes(bytes(ALIGN))
        path.chmod(0o600)  # as the cache makes it
    elif named == "arena-named link":
        path.symlink_to(victim)
    address = await fake_cache(_serve_arena(
        cache_pb2.ArenaInfo(path=str(path), size_bytes=ALIGN, arena_id="x")))
    async with CacheClient(address) as client:
        assert (await client.arena() is not None) == (named == "arena file")
    assert victim.read_bytes() == b"A" * ALIGN


async def test_an_arena_that_failed_to_map_is_asked_for_again_later(
        start_cache, tmp_path, monkeypatch) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena")
    failures = [OSError(errno.EMFILE, "Too many open files")]  # passes

    def flaky(info: cache_pb2.ArenaInfo) -> SharedArena:
        if failures:
            raise failures.pop()
        return SharedArena(info)

    monkeypatch.setattr(arena_calls, "SharedArena", flaky)
    monkeypatch.setattr(arena_calls, "_REMAP_AFTER_S", 1.5)  # a loaded machine's pause is less
    assert await running.client.arena() is None  # streams meanwhile
    assert await running.client.arena() is None  # not asked again at once
    await asyncio.sleep(1.6)
    assert await running.client.arena() is not None


async def test_a_call_waiting_for_another_calls_get_arena_keeps_its_deadline(
        fake_cache) -> None:
    async def stuck(request: object, context: object) -> None:
        await asyncio.sleep(3600)

    address = await fake_cache({"GetArena": grpc.unary_unary_rpc_method_handler(stuck)})
    loop = asyncio.get_running_loop()
    async with CacheClient(address) as client:
        first = asyncio.create_task(client.arena(timeout_s=5))  # holds the lock meanwhile
        await asyncio.sleep(0.1)
        started = loop.time()
        with pytest.raises(errors.DeadlineExceeded, match=r"0\.2 s deadline"):
            await client.arena(timeout_s=0.2)
        assert loop.time() - started < 2
        first.cancel()


async def test_damage_in_the_arena_is_caught_by_the_reader(start_cache, tmp_path) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena")
    data = make_payload(LAYOUT, 64)  # 2 MiB: two chunks of 1 MiB
    await running.client.put("s", LAYOUT, 64, 1024, data)
    entry = running.cache.store._tiers.lookup("s")  # the server's view of the bytes
    assert isinstance(entry.buffer, memoryview)
    entry.buffer[40 * BLOCK] ^= 0xFF
    with pytest.raises(errors.DataLoss, match="chunk 1 hashes to"):
        await running.client.get_into("s", memoryview(np.zeros_like(data)))


async def test_snapshot_on_disk_falls_back_to_streaming(start_cache, tmp_path) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena", memory_budget_bytes=4 * MIB)
    first, second = make_payload(LAYOUT, 96, seed=1), make_payload(LAYOUT, 96, seed=2)
    await running.client.put("a", LAYOUT, 96, 1536, first)
    await running.client.put("b", LAYOUT, 96, 1536, second)  # spills a
    assert (await running.client.stat("a")).tier == cache_pb2.TIER_DISK
    out = np.zeros_like(first)
    await running.client.get_into("a", memoryview(out))
    assert out.tobytes() == first.tobytes()
    stats = await running.client.stats()
    assert (stats.num_gets, stats.num_shared_gets) == (1, 0)  # streamed from disk


async def test_fragmented_arena_evicts_until_one_range_fits(start_cache, tmp_path) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena", memory_budget_bytes=8 * MIB,
                                disk_dir=None, disk_budget_bytes=0, unpinned_share=1.0)
    client = running.client
    sizes = {"a": 96, "b": 64, "c": 96}  # blocks of 32 KiB: 3 + 2 + 3 MiB, the whole arena
    for name, blocks in sizes.items():
        await client.put(name, LAYOUT, blocks, 16, make_payload(LAYOUT, blocks), pinned=False)
    await client.delete("a")
    await client.delete("c")  # 6 MiB free, in two ranges of 3
    big = make_payload(LAYOUT, 128, seed=9)  # 4 MiB: only with b gone
    await client.put("d", LAYOUT, 128, 16, big, pinned=False)
    with pytest.raises(errors.NotFound):
        await client.stat("b")
    out = np.zeros_like(big)
    await client.get_into("d", memoryview(out))
    assert out.tobytes() == big.tobytes()
    assert (await client.stats()).num_evictions == 1
    running.cache.store.check_integrity()


async def test_fragmented_arena_evicts_nothing_when_no_range_would_fit(start_cache,
                                                                       tmp_path) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena", memory_budget_bytes=8 * MIB,
                                disk_dir=None, disk_budget_bytes=0)
    client = running.client
    # 2 MiB each, filling the arena: pinned, unpinned, pinned, unpinned.
    for name, pinned in (("p1", True), ("u1", False), ("p2", True), ("u2", False)):
        await client.put(name, LAYOUT, 64, 16, make_payload(LAYOUT, 64), pinned=pinned)
    # Evicting u1 and u2 frees 4 MiB, but in two ranges of 2: a 4 MiB put
    # cannot fit, so it is refused without dropping either.
    with pytest.raises(errors.ResourceExhausted, match="largest free range 0"):
        await client.put("big", LAYOUT, 128, 16, make_payload(LAYOUT, 128), pinned=False)
    for name in ("u1", "u2"):
        assert (await client.stat(name)).tier == cache_pb2.TIER_MEMORY
    assert (await client.stats()).num_evictions == 0
    running.cache.store.check_integrity()


async def test_client_without_access_streams(start_cache, tmp_path) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena")
    arena = running.cache.store.arena
    assert arena is not None
    os.unlink(arena.path)  # as seen from another host: no such file
    data = make_payload(LAYOUT, 6)
    assert await running.client.arena() is None
    await running.client.put("s", LAYOUT, 6, 96, data)
    out = np.zeros_like(data)
    await running.client.get_into("s", memoryview(out))
    assert out.tobytes() == data.tobytes()
    stats = await running.client.stats()
    assert (stats.num_puts, stats.num_shared_puts, stats.num_shared_gets) == (1, 0, 0)


async def test_cache_without_arena_streams_and_refuses_shared_calls(start_cache) -> None:
    running = await start_cache()
    assert await running.client.arena() is None
    data = make_payload(LAYOUT, 3)
    await running.client.put("s", LAYOUT, 3, 48, data)
    call = running.stub.GetShared()
    await call.write(cache_pb2.GetSharedRequest(open=cache_pb2.GetSnapshotRequest(
        snapshot_id="s")))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no arena" in (info.value.details() or "")


# -- bad shared calls -------------------------------------------------------------------


async def _shared_put_error(stub, *messages: cache_pb2.PutSharedRequest) -> grpc.aio.AioRpcError:
    call = stub.PutShared(timeout=30)
    for message in messages:
        await call.write(message)
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while await call.read() is not grpc.aio.EOF:
            pass
    return info.value


async def test_bad_shared_puts_leave_nothing(start_cache, tmp_path) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena", shared_lease_s=0.5)
    header = make_header("s", LAYOUT, 64, chunk_bytes=MIB)  # 2 MiB: 2 chunks
    commit = cache_pb2.PutSharedRequest(commit=cache_pb2.SharedPutCommit(checksums=[1, 2]))
    cases = [
        ((commit,), grpc.StatusCode.INVALID_ARGUMENT, "expected a header message"),
        ((), grpc.StatusCode.INVALID_ARGUMENT, "expected a header message"),
        ((cache_pb2.PutSharedRequest(header=header),), grpc.StatusCode.INVALID_ARGUMENT,
         "expected a commit message"),
        ((cache_pb2.PutSharedRequest(header=header),
          cache_pb2.PutSharedRequest(commit=cache_pb2.SharedPutCommit(checksums=[1]))),
         grpc.StatusCode.INVALID_ARGUMENT, "commit has 1 checksums"),
        ((cache_pb2.PutSharedRequest(header=make_header("s", LAYOUT, 2048)),),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "more than the memory budget"),
    ]
    for messages, code, message in cases:
        error = await _shared_put_error(running.stub, *messages)
        assert (error.code(), message in (error.details() or "")) == (code, True), error
    # The extent of the put whose stream ended after its header waits out a
    # quarantine: grpc reads a cancelled call as that too.
    arena = running.cache.store.arena
    await wait_until(lambda: arena.free_bytes == arena.size, "the quarantine ended")
    await running.assert_nothing_left()


@pytest.mark.parametrize(("deadline_s", "lease_s"), [(30, 1.0), (0.5, 1.5)],
                         ids=["lease", "deadline"])
async def test_an_extent_cut_off_mid_write_is_quarantined(start_cache, tmp_path, deadline_s,
                                                          lease_s) -> None:
    """A writer whose lease ran out, or whose call's deadline passed, may still
    be copying into its extent: for another lease no other put gets it, then
    it is reused, and the whole arena is free again."""
    running = await start_cache(arena_dir=tmp_path / "arena", memory_budget_bytes=4 * MIB,
                                disk_dir=None, disk_budget_bytes=0, shared_lease_s=lease_s)
    client, store = running.client, running.cache.store
    arena = await client.arena()  # mapped here, as a writer maps it
    assert arena is not None
    call = running.stub.PutShared(timeout=deadline_s)
    header = make_header("late", LAYOUT, 128)  # 4 MiB: the whole arena
    await call.write(cache_pb2.PutSharedRequest(header=header))
    late = arena.view((await call.read()).extent)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()  # never commits
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ("lease" in (info.value.details() or "")) == (deadline_s > lease_s)
    stats = await client.stats()
    assert (stats.reserved_bytes, stats.num_failed_puts, stats.free_bytes) == (0, 1, 0)
    store.check_integrity()

    data = make_payload(LAYOUT, 128, seed=5)
    putting = asyncio.create_task(client.put("next", LAYOUT, 128, 16, data))
    await asyncio.sleep(lease_s / 2)
    late[:] = b"x" * late.nbytes  # the late copy lands, in no one else's bytes
    assert not putting.done()  # waiting for the quarantine to end
    assert await putting == data.nbytes
    assert store.extent_of(store._tiers.lookup("next").buffer) == (0, 4 * MIB)  # reused
    out = np.zeros_like(data)
    await client.get_into("next", memoryview(out))
    assert out.tobytes() == data.tobytes()
    await client.delete("next")
    await running.assert_nothing_left()


@pytest.mark.parametrize("method", ["PutShared", "GetShared"])
async def test_a_shared_call_that_sends_nothing_ends(start_cache, tmp_path, method) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena", shared_lease_s=0.3)
    call = getattr(running.stub, method)()  # no deadline, and no first message
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call.read(), 10)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "sent nothing within the 0.3 s lease" in (info.value.details() or "")


async def test_shared_get_must_start_at_chunk_zero(start_cache, tmp_path) -> None:
    running = await start_cache(arena_dir=tmp_path / "arena")
    await running.client.put("s", LAYOUT, 64, 16, make_payload(LAYOUT, 64))
    call = running.stub.GetShared(timeout=30)
    await call.write(cache_pb2.GetSharedRequest(open=cache_pb2.GetSnapshotRequest(
        snapshot_id="s", start_chunk=1)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- real processes --------------------------------------------------------------------

_HALF_WRITER = textwrap.dedent("""
    import asyncio, sys
    from kvstash.cache_sdk.cache_client import CacheClient
    from kvstash.common.layout import Layout

    async def main():
        layout = Layout(num_layers=2, block_size=16, num_kv_heads=4, head_dim=64,
                        dtype="bfloat16")
        client = CacheClient(sys.argv[1])

        async def write_half(extent, lease):
            extent[: extent.nbytes // 2] = b"x" * (extent.nbytes // 2)
            print("WRITING", flush=True)
            await asyncio.sleep(3600)

        await client.put_shared("victim", layout, 64, 1024, 64 * 32768, write_half)

    asyncio.run(main())
""")


async def test_writer_killed_mid_put_leaves_nothing(tmp_path, processes) -> None:
    cache = start_cache_process("--memory-budget", "8MiB", "--arena-dir", str(tmp_path),
                                "--shared-lease", "1s")
    processes.append(cache)
    writer = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HALF_WRITER, cache.address, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=asyncio.subprocess.PIPE)
    try:
        assert writer.stdout is not None
        assert await asyncio.wait_for(writer.stdout.readline(), 60) == b"WRITING\n"
        async with CacheClient(cache.address) as client:
            assert (await client.stats()).reserved_bytes == 2 * MIB  # its extent
            writer.kill()
            await writer.wait()

            async def reclaimed() -> bool:
                stats = await client.stats()
                return stats.reserved_bytes == 0 and stats.num_failed_puts == 1

            await wait_until(reclaimed, "the killed writer's put ended")
            with pytest.raises(errors.NotFound):
                await client.stat("victim")

            async def all_free() -> bool:  # after a quarantine: its DMA might still land
                return (await client.stats()).free_bytes == 8 * MIB

            await wait_until(all_free, "the killed writer's extent came back")
            # The whole budget is there again, in one range: 8 MiB fit.
            data = make_payload(LAYOUT, 256)
            await client.put("whole", LAYOUT, 256, 16, data)
            out = np.zeros_like(data)
            await client.get_into("whole", memoryview(out))
            assert out.tobytes() == data.tobytes()
    finally:
        if writer.returncode is None:
            writer.kill()


async def test_restart_keeps_the_disk_tier_and_drops_the_arena(tmp_path, processes) -> None:
    arena_dir, disk = tmp_path / "arena", tmp_path / "disk"
    args = ("--memory-budget", "4MiB", "--arena-dir", str(arena_dir), "--disk-dir", str(disk),
            "--disk-budget", "64MiB")
    first = start_cache_process(*args)
    processes.append(first)
    payloads = {name: make_payload(LAYOUT, 96, seed=i) for i, name in enumerate("ab")}
    async with CacheClient(first.address) as client:
        for name, data in payloads.items():
            await client.put(name, LAYOUT, 96, 1536, data)  # b spills a
        assert (await client.stat("a")).tier == cache_pb2.TIER_DISK
        old_arena = (await client.arena())
        assert old_arena is not None
    [old_file] = os.listdir(arena_dir)
    first.kill()
    assert os.listdir(arena_dir) == [old_file]  # a crash leaves it behind

    second = start_cache_process(*args)
    processes.append(second)
    [new_file] = os.listdir(arena_dir)  # the stale one is gone
    assert new_file != old_file
    async with CacheClient(second.address) as client:
        out = np.zeros_like(payloads["a"])
        await client.get_into("a", memoryview(out))
        assert out.tobytes() == payloads["a"].tobytes()
        with pytest.raises(errors.NotFound):  # the memory tier died with the process
            await client.stat("b")
        data = make_payload(LAYOUT, 16, seed=7)
        await client.put("c", LAYOUT, 16, 256, data)
        assert (await client.stats()).num_shared_puts == 1
    assert second.terminate() == 0
    assert os.listdir(arena_dir) == []  # a clean stop removes it


async def test_a_client_streams_once_its_cache_comes_back_without_an_arena(
        tmp_path, processes) -> None:
    first = start_cache_process("--memory-budget", "8MiB", "--arena-dir", str(tmp_path))
    processes.append(first)
    async with CacheClient(first.address) as client:  # one client, as a worker keeps
        await client.put("a", LAYOUT, 16, 256, make_payload(LAYOUT, 16))
        assert await client.arena() is not None  # mapped
        first.kill()
        second = start_cache_process("--memory-budget", "8MiB", "--listen", first.address)
        processes.append(second)
        for seed, name in enumerate(("b", "c")):
            data = make_payload(LAYOUT, 16, seed=seed)
            await client.put(name, LAYOUT, 16, 256, data)
            out = np.zeros_like(data)
            await client.get_into(name, memoryview(out))
            assert out.tobytes() == data.tobytes()
        stats = await client.stats()
        assert (stats.num_puts, stats.num_shared_puts) == (2, 0)
        assert await client.arena() is None

