"""The disk tier failing a get: damage at rest reaches the client as DataLoss
(the file keeps the checksums verified at put time), a vanished or short file
is a clear status naming the snapshot and chunk, and the server stays healthy."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cache_helpers import MIB, make_layout, make_payload, wait_until

from cache_svc.disk import DATA_OFFSET, DiskFiles
from cache_svc.model import Residence
from cache_svc.snapshot import SnapshotMeta
from kvstash import errors
from kvstash.common.layout import Layout
from kvstash.v1 import cache_pb2

LAYOUT = make_layout()  # 32 KiB blocks
NUM_BLOCKS = 128  # 4 MiB: 4 chunks of 1 MiB
PAYLOADS = {name: make_payload(LAYOUT, NUM_BLOCKS, seed=i).tobytes()
            for i, name in enumerate("abc")}


async def put_two_spilled(start_cache, **overrides):
    """A server with 4 MiB of memory after puts of a, b and c: a and b were
    spilled to disk, c is in memory."""
    running = await start_cache(memory_budget_bytes=4 * MIB, **overrides)
    for name, data in PAYLOADS.items():
        await running.client.put(name, LAYOUT, NUM_BLOCKS, 0, data)
    for name in "ab":
        assert (await running.client.stat(name)).tier == cache_pb2.TIER_DISK
    return running


def file_of(running, snapshot_id: str) -> Path:
    (path,) = [p for p in running.disk_dir.iterdir() if p.name.startswith(snapshot_id + "~")]
    return path


def patch(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, offset) == len(data)
    finally:
        os.close(fd)


async def assert_healthy(running, gone: str) -> None:
    """The damaged snapshot is gone; b still round-trips; accounting holds."""
    with pytest.raises(errors.NotFound):
        await running.client.stat(gone)
    assert (await running.client.get("b"))[1] == PAYLOADS["b"]
    await wait_until(lambda: not any(n.startswith(gone + "~") for n in running.disk_files()),
                     f"the file of {gone} is removed")
    running.cache.store.check_integrity()


@pytest.mark.parametrize("restart", [False, True], ids=["spilled", "after_restart"])
async def test_flipped_byte_on_disk_is_data_loss(start_cache, restart: bool) -> None:
    running = await put_two_spilled(start_cache)
    if restart:
        await running.cache.stop(0)
    path = file_of(running, "a")
    offset = DATA_OFFSET + 2 * MIB + 12345  # one byte of chunk 2's payload
    patch(path, offset, bytes([path.read_bytes()[offset] ^ 0x01]))
    if restart:
        running = await start_cache(memory_budget_bytes=4 * MIB)
        assert (await running.client.stat("a")).tier == cache_pb2.TIER_DISK
    out = np.zeros(len(PAYLOADS["a"]), np.uint8)
    with pytest.raises(errors.DataLoss, match="snapshot a: chunk 2 checksum"):
        await running.client.get_into("a", memoryview(out))
    # The damage is confined to chunk 2: a resumed get of chunk 3 is intact.
    await running.client.get_into("a", memoryview(out), start_chunk=3)
    assert out[3 * MIB :].tobytes() == PAYLOADS["a"][3 * MIB :]
    assert (await running.client.get("b"))[1] == PAYLOADS["b"]
    running.cache.store.check_integrity()


async def test_files_without_checksums_are_removed_at_rescan(start_cache) -> None:
    running = await put_two_spilled(start_cache)
    await running.cache.stop(0)
    # a: the previous format (magic KVSNAP01, no checksum trailer).
    old = file_of(running, "a")
    patch(old, 0, b"KVSNAP01")
    os.truncate(old, DATA_OFFSET + 4 * MIB)
    # b: the current head, its trailer cut off.
    os.truncate(file_of(running, "b"), DATA_OFFSET + 4 * MIB)

    running = await start_cache(memory_budget_bytes=4 * MIB)
    for name in "ab":
        with pytest.raises(errors.NotFound):
            await running.client.stat(name)
    assert running.disk_files() == []
    stats = await running.client.stats()
    assert stats.disk_snapshots == stats.disk_bytes == 0


def test_disk_files_round_trip_checksums(tmp_path) -> None:
    disk = DiskFiles(tmp_path)
    meta = SnapshotMeta("x", Layout(2, 16, 4, 64, "float16"), NUM_BLOCKS, 0, 4 * MIB, MIB,
                        pinned=True, ttl_s=60)
    checksums = (0, 1, 2**64 - 1, 12345)
    disk.write(meta, memoryview(PAYLOADS["a"]), checksums)
    (found,) = disk.scan()
    assert (found.meta, found.checksums) == (meta, checksums)
    with pytest.raises(ValueError, match="4 chunks, got 3 checksums"):
        disk.write(meta, memoryview(PAYLOADS["a"]), checksums[:3])


@pytest.mark.parametrize("failing", ["rename", "fsync_dir"])
def test_a_spill_failing_at_its_last_step_leaves_no_file(tmp_path, monkeypatch,
                                                         failing: str) -> None:
    """A write whose rename or directory sync fails counts as failed, so no
    file of it may stay: a stray temporary would fill the disk unseen, and a
    final one would come back as a snapshot at the next scan."""
    disk = DiskFiles(tmp_path)
    meta = SnapshotMeta("x", Layout(2, 16, 4, 64, "float16"), NUM_BLOCKS, 0, 4 * MIB, MIB,
                        pinned=True, ttl_s=60)

    def fail(*args: object) -> None:
        raise OSError(5, f"{failing} failed")

    if failing == "rename":
        monkeypatch.setattr(os, "rename", fail)
    else:
        monkeypatch.setattr(disk, "_fsync_dir", fail)
    with pytest.raises(OSError, match=f"{failing} failed"):
        disk.write(meta, memoryview(PAYLOADS["a"]), (0, 1, 2, 3))
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == [] and disk.scan() == []


async def test_a_failing_disk_is_not_written_again_and_again(start_cache, monkeypatch) -> None:
    """A disk that refuses a spill (full, failing) is given a rest: the put
    that needed the room is refused at once, RESOURCE_EXHAUSTED, rather than
    rewriting the same snapshot to it until the put's wait runs out; what is
    in memory stays readable."""
    running = await start_cache(memory_budget_bytes=4 * MIB)
    await running.client.put("a", LAYOUT, NUM_BLOCKS, 0, PAYLOADS["a"])
    writes = []

    def full_disk(self: DiskFiles, *args: object) -> None:
        writes.append(args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskFiles, "write", full_disk)
    started = asyncio.get_running_loop().time()
    with pytest.raises(errors.ResourceExhausted, match="need 4194304 bytes"):
        await running.client.put("b", LAYOUT, NUM_BLOCKS, 0, PAYLOADS["b"])
    assert len(writes) == 1
    assert asyncio.get_running_loop().time() - started < 10  # the test's wait is 30 s
    assert (await running.client.get("a"))[1] == PAYLOADS["a"]


async def test_in_a_failing_disks_rest_no_snapshot_on_it_is_evicted_to_spill(
        start_cache, monkeypatch) -> None:
    """The rest holds with unpinned snapshots on the disk too: none is evicted
    to make room there for a spill that would write to it again."""
    running = await start_cache(memory_budget_bytes=8 * MIB, unpinned_share=1.0)  # 64 MiB disk
    client = running.client
    await client.put("u", LAYOUT, NUM_BLOCKS, 0, PAYLOADS["c"], pinned=False)
    for name in "ab":  # b spills u
        await client.put(name, LAYOUT, NUM_BLOCKS, 0, PAYLOADS[name])
    assert (await client.stat("u")).tier == cache_pb2.TIER_DISK
    writes = []

    def failing_disk(self: DiskFiles, meta: SnapshotMeta, *args: object) -> None:
        writes.append(meta.snapshot_id)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(DiskFiles, "write", failing_disk)
    with pytest.raises(errors.ResourceExhausted):
        await client.put("p", LAYOUT, NUM_BLOCKS, 0, PAYLOADS["c"])
    assert writes == ["a"]
    assert (await client.stat("u")).tier == cache_pb2.TIER_DISK
    running.cache.store.check_integrity()


async def test_get_racing_a_delete_is_unavailable(start_cache, monkeypatch) -> None:
    running = await put_two_spilled(start_cache)
    opening, go_on = threading.Event(), threading.Event()
    real_open = DiskFiles.open

    def held_open(self: DiskFiles, path: Path) -> int:
        opening.set()
        go_on.wait(30)
        return real_open(self, path)

    monkeypatch.setattr(DiskFiles, "open", held_open)
    get = asyncio.ensure_future(running.client.get("a"))
    assert await asyncio.to_thread(opening.wait, 30)
    await running.client.delete("a")  # unlinks the file on the other I/O thread
    await wait_until(lambda: not any(n.startswith("a~") for n in running.disk_files()),
                     "the deleted file is unlinked")
    go_on.set()
    with pytest.raises(errors.Unavailable,
                       match=r"^cache: snapshot 'a', chunk 0: "
                             "the snapshot was deleted while being read$"):
        await get
    monkeypatch.undo()
    await assert_healthy(running, gone="a")


async def test_a_get_cancelled_while_its_file_opens_closes_it(start_cache, monkeypatch) -> None:
    """The thread opening a get's file cannot be stopped: when the get is
    cancelled meanwhile, the file the thread goes on to open is closed."""
    running = await put_two_spilled(start_cache)
    entry = running.cache.store._tiers.lookup("a")
    real_open = DiskFiles.open
    gates: list[tuple[threading.Event, threading.Event]] = []

    def held_open(self: DiskFiles, path: Path) -> int:
        opening, go_on = gates[-1]
        opening.set()
        go_on.wait(30)
        return real_open(self, path)

    monkeypatch.setattr(DiskFiles, "open", held_open)
    num_fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        gates.append((threading.Event(), threading.Event()))
        opening, go_on = gates[-1]
        get = asyncio.ensure_future(running.client.get("a"))
        assert await asyncio.to_thread(opening.wait, 30)
        get.cancel()
        with pytest.raises(asyncio.CancelledError):
            await get
        await wait_until(lambda: entry.num_readers == 0, "the server's get was cancelled")
        go_on.set()  # the file opens, for a get that is gone
    await wait_until(lambda: len(os.listdir("/proc/self/fd")) == num_fds,
                     "the files opened for cancelled gets are closed", timeout_s=5)
    monkeypatch.undo()
    assert (await running.client.get("a"))[1] == PAYLOADS["a"]
    running.cache.store.check_integrity()


async def test_delete_during_a_disk_read_lets_the_get_finish(start_cache, monkeypatch) -> None:
    running = await put_two_spilled(start_cache)
    reading, go_on = threading.Event(), threading.Event()
    real_read = DiskFiles.read

    def held_read(self: DiskFiles, fd: int, start: int, end: int) -> bytes:
        if start == MIB:  # chunk 1
            reading.set()
            go_on.wait(30)
        return real_read(self, fd, start, end)

    monkeypatch.setattr(DiskFiles, "read", held_read)
    get = asyncio.ensure_future(running.client.get("a"))
    assert await asyncio.to_thread(reading.wait, 30)
    await running.client.delete("a")
    await wait_until(lambda: not any(n.startswith("a~") for n in running.disk_files()),
                     "the deleted file is unlinked")
    go_on.set()
    assert (await get)[1] == PAYLOADS["a"]  # the open file still reads
    monkeypatch.undo()
    await assert_healthy(running, gone="a")


async def test_short_file_is_data_loss_and_unlisted(start_cache) -> None:
    running = await put_two_spilled(start_cache)
    os.truncate(file_of(running, "a"), DATA_OFFSET + MIB + MIB // 2)  # chunk 1 half there
    with pytest.raises(errors.DataLoss,
                       match=r"snapshot 'a', chunk 1: file is short: "
                             "wanted 1048576 payload bytes at 1048576, got 524288"):
        await running.client.get("a")
    await assert_healthy(running, gone="a")
    assert (await running.client.stats()).disk_snapshots == 1


async def test_missing_file_is_data_loss_and_unlisted(start_cache) -> None:
    running = await put_two_spilled(start_cache)
    file_of(running, "a").unlink()
    with pytest.raises(errors.DataLoss,
                       match=r"snapshot 'a', chunk 2: the file is missing"):
        await running.client.get_into("a", memoryview(bytearray(4 * MIB)), start_chunk=2)
    await assert_healthy(running, gone="a")


async def test_a_disk_tier_recovered_over_a_smaller_budget_gets_back_within_it(
        start_cache) -> None:
    """Restarted with half the disk budget over 4 MiB of unpinned snapshots:
    the oldest go at start, and a later spill evicts what it needs from what
    is left, so the disk tier holds no more than its budget again (a spill
    judged its room from a free figure clamped at 0: it evicted one snapshot
    per one spilled, and the tier stayed over for good)."""
    one_mib = 32  # blocks of LAYOUT
    running = await start_cache(memory_budget_bytes=4 * MIB, unpinned_share=1.0)
    for i in range(8):  # u0..u3 spill to disk, u4..u7 stay in memory
        await running.client.put(f"u{i}", LAYOUT, one_mib, 0,
                                 make_payload(LAYOUT, one_mib, seed=i), pinned=False)
    stats = await running.client.stats()
    assert stats.disk_snapshots == 4
    charge = stats.disk_bytes // 4  # a file of 1 MiB and its head, in pages
    await running.cache.stop(0)

    running = await start_cache(memory_budget_bytes=4 * MIB, disk_budget_bytes=2 * charge,
                                unpinned_share=1.0)
    stats = await running.client.stats()
    assert (stats.disk_bytes, stats.disk_snapshots, stats.num_evictions) == (2 * charge, 2, 2)
    for name in ("u0", "u1"):  # the oldest went
        with pytest.raises(errors.NotFound):
            await running.client.stat(name)
    await wait_until(lambda: len(running.disk_files()) == 2, "the evicted files are removed")
    for i in range(5):  # p0..p3 fill memory; p4 makes p0 spill
        await running.client.put(f"p{i}", LAYOUT, one_mib, 0,
                                 make_payload(LAYOUT, one_mib, seed=10 + i))
    assert (await running.client.stat("p0")).tier == cache_pb2.TIER_DISK
    stats = await running.client.stats()
    assert stats.disk_bytes <= stats.disk_budget_bytes == 2 * charge
    running.cache.store.check_integrity()


async def test_a_deleted_snapshot_stays_deleted_through_a_crash(start_cache, tmp_path) -> None:
    """DeleteSnapshot answers once the file is unlinked, not queued behind a
    spill on the disk threads: the disk as a crash right after the answer
    leaves it (copied then) holds no deleted snapshot for a restart to find."""
    one_mib = 32  # blocks of LAYOUT
    running = await start_cache(memory_budget_bytes=4 * MIB, io_threads=1,
                                disk_write_bytes_per_s=MIB)  # a spill takes 1 s

    async def put(name: str) -> None:
        await running.client.put(name, LAYOUT, one_mib, 0,
                                 make_payload(LAYOUT, one_mib, seed=len(name)))

    for i in range(5):  # a4 makes a0 spill
        await put(f"a{i}")
    await wait_until(lambda: running.cache.store.stat("a0").tier.value == "disk", "a0 spilled")
    spilling = asyncio.ensure_future(put("a5"))  # a1 spills: the disk thread is busy
    await wait_until(lambda: running.disk_files() and any(
        n.startswith(".tmp") for n in running.disk_files()), "a1 being written")
    await running.client.delete("a0")
    crashed = tmp_path / "after_crash"
    shutil.copytree(running.disk_dir, crashed)  # what a crash now leaves on disk
    await spilling
    restarted = await start_cache(memory_budget_bytes=4 * MIB, disk_dir=crashed)
    with pytest.raises(errors.NotFound):
        await restarted.client.stat("a0")


async def test_a_delete_answers_once_its_unlink_is_durable(start_cache, monkeypatch) -> None:
    """An unlink is durable only once its directory is fsynced: without that
    a power loss after the delete answered could bring the file back, for
    the restart to list again."""
    one_mib = 32  # blocks of LAYOUT
    running = await start_cache(memory_budget_bytes=4 * MIB)
    for i in range(8):  # a0..a3 spill
        await running.client.put(f"a{i}", LAYOUT, one_mib, 0, make_payload(LAYOUT, one_mib))
    await wait_until(lambda: len(running.disk_files()) == 4, "a0..a3 spilled")
    disk_dir = str(running.disk_dir.resolve())
    events: list[str] = []
    unlink, fsync = os.unlink, os.fsync

    def watched_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        events.append("unlink")
        unlink(path, *args, **kwargs)

    def watched_fsync(fd: int) -> None:
        fsync(fd)
        if os.readlink(f"/proc/self/fd/{fd}") == disk_dir:
            events.append("fsync dir")

    monkeypatch.setattr(os, "unlink", watched_unlink)
    monkeypatch.setattr(os, "fsync", watched_fsync)
    await running.client.delete("a0")
    assert events == ["unlink", "fsync dir"]
    await asyncio.gather(*(running.client.delete(f"a{i}") for i in range(1, 4)))
    assert events.count("unlink") == 4 and events[-1] == "fsync dir"
    assert running.disk_files() == []


async def test_a_snapshot_deleted_while_spilling_stays_deleted_through_a_crash(
        start_cache, tmp_path, monkeypatch) -> None:
    """Deleted while its file is being written, it has no file yet: the delete
    answers only once the spill has ended and unlinked what it wrote (it
    answered at once, and a crash before that unlink brought it back). Here
    the delete comes just after the spill's last check that the snapshot is
    still wanted, so its file is put in place."""
    running = await start_cache(memory_budget_bytes=4 * MIB, io_threads=1,
                                disk_write_bytes_per_s=2 * MIB)  # a spill takes 0.5 s
    tiers = running.cache.store._tiers
    release = threading.Event()
    write, remove = DiskFiles.write, tiers.disk.remove

    def unchecked_write(self: DiskFiles, meta: SnapshotMeta, payload: memoryview,
                        checksums: tuple[int, ...], wanted: object) -> Path | None:
        return write(self, meta, payload, checksums)

    def held_remove(path: Path) -> None:  # the unlink waits for the test
        release.wait(10)
        remove(path)

    monkeypatch.setattr(DiskFiles, "write", unchecked_write)
    tiers.disk.remove = held_remove
    one_mib = 32  # blocks of LAYOUT

    def put(name: str) -> Awaitable[object]:
        return running.client.put(name, LAYOUT, one_mib, 0, make_payload(LAYOUT, one_mib))

    for i in range(4):
        await put(f"a{i}")
    spilling = asyncio.ensure_future(put("a4"))  # a0 spills
    await wait_until(lambda: tiers.get("a0") is not None
                     and tiers.get("a0").residence.value == "spilling", "a0 spilling")
    delete = asyncio.ensure_future(running.client.delete("a0"))
    await spilling
    await wait_until(lambda: any(n.startswith("a0~") for n in running.disk_files()),
                     "a0's file in place, its unlink held")
    assert not delete.done()  # not answered while its file is there
    release.set()
    await delete
    crashed = tmp_path / "after_crash"
    shutil.copytree(running.disk_dir, crashed)  # what a crash now leaves on disk
    restarted = await start_cache(memory_budget_bytes=4 * MIB, disk_dir=crashed)
    with pytest.raises(errors.NotFound):
        await restarted.client.stat("a0")


async def test_a_snapshot_deleted_while_spilling_never_replaces_its_successor_after_a_crash(
        start_cache, tmp_path, monkeypatch) -> None:
    """Its file is not put in place once written: a crash before that file
    was unlinked again brought it back, as the newest file of its id, instead
    of the snapshot put under the id since, and spilled first."""
    config = {"memory_budget_bytes": 16 * MIB, "unpinned_share": 0.25, "io_threads": 2}
    running = await start_cache(**config)
    tiers = running.cache.store._tiers
    v1_goes_on, unlinks_go_on = threading.Event(), threading.Event()
    write, remove = DiskFiles.write, tiers.disk.remove
    writes: list[str] = []

    def held_write(self: DiskFiles, meta: SnapshotMeta, *args: Any) -> Path | None:
        writes.append(meta.snapshot_id)
        if writes.count("a") == 1 and meta.snapshot_id == "a":
            v1_goes_on.wait(30)  # v1's spill, until v2 is on disk
        return write(self, meta, *args)

    def held_remove(path: Path) -> None:  # the crash comes first
        if path.name.startswith("a~"):
            unlinks_go_on.wait(30)
        remove(path)

    monkeypatch.setattr(DiskFiles, "write", held_write)
    tiers.disk.remove = held_remove

    async def put(name: str, data: bytes) -> None:
        await running.client.put(name, LAYOUT, NUM_BLOCKS, 0, data, pinned=False)

    v1, v2 = PAYLOADS["a"], PAYLOADS["b"]
    try:
        await put("a", v1)
        await put("u1", PAYLOADS["c"])  # over the share: v1 spills
        entry = tiers.lookup("a")
        deleting = asyncio.ensure_future(running.client.delete("a"))
        await wait_until(lambda: not tiers.is_listed("a"), "v1 deleted while spilling")
        await put("a", v2)  # u1 spills, on the other thread
        await put("u2", PAYLOADS["c"])  # v2 spills
        await wait_until(lambda: tiers.lookup("a").residence is Residence.DISK, "v2 on disk")
        v1_goes_on.set()
        await wait_until(lambda: entry.residence is not Residence.SPILLING, "v1's spill ended")
        crashed = tmp_path / "after_crash"
        shutil.copytree(running.disk_dir, crashed)  # what a crash now leaves on disk
    finally:
        v1_goes_on.set()
        unlinks_go_on.set()
    await deleting
    assert len([n for n in running.disk_files() if "a~" in n]) == 1  # v2's; none of v1
    restarted = await start_cache(**config, disk_dir=crashed)
    assert (await restarted.client.get("a"))[1] == v2


async def test_a_recovered_snapshot_is_idle_since_its_file_was_last_written_or_read(
        start_cache) -> None:
    """Its TTL used to start again at every restart: in a crash loop an
    orphan on disk never expired. Reading it from disk marks the file."""
    running = await put_two_spilled(start_cache)
    a, b = file_of(running, "a"), file_of(running, "b")
    hour_ago = time.time() - 3600
    os.utime(b, (hour_ago, hour_ago))
    await running.client.get("b")  # read from disk: marked as read now
    assert time.time() - b.stat().st_mtime < 60
    ttl_s = (await running.client.stat("a")).header.ttl_s
    await running.cache.stop(0)
    long_ago = time.time() - ttl_s - 60
    os.utime(a, (long_ago, long_ago))

    running = await start_cache(memory_budget_bytes=4 * MIB)
    assert running.cache.store.sweep_expired() == 1
    with pytest.raises(errors.NotFound):
        await running.client.stat("a")
    assert (await running.client.get("b"))[1] == PAYLOADS["b"]
