"""Real `python -m cache_svc` processes: restart recovery, resident memory
under many concurrent streams, graceful shutdown."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from cache_helpers import (
    MIB,
    REPO,
    make_layout,
    make_payload,
    on_disk,
    start_cache_process,
    wait_until,
)

from cache_svc.config import CacheConfig
from cache_svc.server import create_cache_server
from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common.binding import BindError
from kvstash.v1 import cache_pb2

LAYOUT = make_layout("bfloat16")  # 32 KiB blocks
NUM_BLOCKS = 128  # 4 MiB


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
        return response.read().decode()


async def test_disk_tier_survives_sigkill(tmp_path, processes) -> None:
    disk = tmp_path / "disk"
    args = ("--memory-budget", "8MiB", "--disk-dir", str(disk), "--disk-budget", "64MiB")
    first = start_cache_process(*args)
    processes.append(first)
    payloads = {name: make_payload(LAYOUT, NUM_BLOCKS, seed=i) for i, name in enumerate("abc")}
    async with CacheClient(first.address) as client:
        for name, data in payloads.items():
            await client.put(name, LAYOUT, NUM_BLOCKS, 100, data, ttl_s=3600)
        assert (await client.stat("a")).tier == cache_pb2.TIER_DISK
    first.kill()
    (disk / ".tmp~a~0123456789abcdef").write_bytes(b"half a snapshot")  # a crash mid-spill

    second = start_cache_process(*args)
    processes.append(second)
    async with CacheClient(second.address) as client:
        out = np.zeros_like(payloads["a"])
        header = await client.get_into("a", memoryview(out))
        assert out.tobytes() == payloads["a"].tobytes()
        assert (header.num_tokens, header.ttl_s, header.pinned) == (100, 3600, True)
        for lost in "bc":  # memory-tier snapshots die with the process
            with pytest.raises(errors.NotFound):
                await client.stat(lost)
        stats = await client.stats()
        assert (stats.disk_snapshots, stats.disk_bytes) == (1, on_disk(1, chunk_bytes=2 * MIB))
    assert [p.name for p in disk.iterdir() if p.name.startswith(".tmp")] == []


async def test_resident_memory_bounded_under_32_streams(tmp_path, processes) -> None:
    budget, inflight = 48 * MIB, 16 * MIB
    process = start_cache_process(
        "--memory-budget", "48MiB", "--disk-dir", str(tmp_path / "disk"),
        "--disk-budget", "512MiB", "--max-inflight", "16MiB", "--reserve-wait", "60",
    )
    processes.append(process)
    baseline = process.rss_bytes()
    payloads = [make_payload(LAYOUT, NUM_BLOCKS, seed=i) for i in range(32)]  # 128 MiB
    clients = [CacheClient(process.address, chunk_bytes=(1 + i % 4) * MIB) for i in range(4)]
    try:
        await asyncio.gather(*(clients[i % 4].put(f"s{i}", LAYOUT, NUM_BLOCKS, 0, p)
                               for i, p in enumerate(payloads)))
        outs = [np.zeros_like(p) for p in payloads]
        await asyncio.gather(*(clients[i % 4].get_into(f"s{i}", memoryview(o))
                               for i, o in enumerate(outs)))
        stats = await clients[0].stats()
    finally:
        for client in clients:
            await client.close()
    for p, o in zip(payloads, outs, strict=True):
        assert o.tobytes() == p.tobytes()
    peak = process.rss_bytes("VmHWM")
    config = CacheConfig(memory_budget_bytes=budget, max_inflight_bytes=inflight)
    limit = baseline + budget + config.overhead_bytes(32)  # the documented bound
    print(f"baseline {baseline / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB, "
          f"limit {limit / MIB:.0f} MiB, spills {stats.num_spills}")
    assert stats.num_spills >= 20 and stats.memory_bytes <= budget
    assert peak <= limit, f"peak RSS {peak / MIB:.0f} MiB > {limit / MIB:.0f} MiB"


async def test_a_second_cache_on_the_same_disk_dir_is_refused(tmp_path, processes) -> None:
    """Two caches on one disk tier would each list the other's files: the
    second one started, and a delete there made the first's get of that
    snapshot DATA_LOSS (its start also removes the first's spills in progress
    and evicts its files over its own budget). It is refused at start."""
    disk = tmp_path / "disk"
    args = ("--memory-budget", "4MiB", "--disk-dir", str(disk), "--disk-budget", "64MiB")
    first = start_cache_process(*args)
    processes.append(first)
    payloads = {name: make_payload(LAYOUT, NUM_BLOCKS, seed=i) for i, name in enumerate("ab")}
    async with CacheClient(first.address) as client:
        for name, data in payloads.items():
            await client.put(name, LAYOUT, NUM_BLOCKS, 100, data)  # b spills a
        assert (await client.stat("a")).tier == cache_pb2.TIER_DISK
        second = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "cache_svc", "--listen", "127.0.0.1:0", *args, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        try:
            assert second.stdout is not None and second.stderr is not None
            ready = await asyncio.wait_for(second.stdout.readline(), 60)
            assert ready == b"", "a second cache started on the first one's disk tier"
            assert await asyncio.wait_for(second.wait(), 60) == 1
            error = (await second.stderr.read()).decode()
            assert f"disk tier {disk} is in use by another cache" in error, error
        finally:
            if second.returncode is None:
                second.kill()
                await second.wait()
        out = np.zeros_like(payloads["a"])
        await client.get_into("a", memoryview(out))
        assert out.tobytes() == payloads["a"].tobytes()
        assert {p.name.split("~")[0] for p in disk.iterdir()} == {"a"}


def test_a_cache_refused_a_disk_tier_in_use_leaves_no_arena_behind(
        tmp_path, processes) -> None:
    """The second cache on a --disk-dir had already made its --arena-dir
    arena (its whole memory budget, in /dev/shm as deployed) when the disk
    tier was found in use: it exited 1 leaving that file, memory no one
    uses, until some cache started again in that directory."""
    disk, arena = tmp_path / "disk", tmp_path / "arena"
    args = ("--memory-budget", "4MiB", "--disk-dir", str(disk), "--disk-budget", "64MiB")
    processes.append(start_cache_process(*args))
    second = subprocess.run(
        [sys.executable, "-m", "cache_svc", "--listen", "127.0.0.1:0", *args,
         "--arena-dir", str(arena)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120, check=False)
    assert second.returncode == 1 and "is in use by another cache" in second.stderr, (
        second.stderr)
    assert list(arena.iterdir()) == []


async def test_a_cache_that_could_not_bind_leaves_its_disk_tier_free(tmp_path) -> None:
    """A cache made in-process whose port was taken kept its disk tier's
    lock (its store was never closed): the next one on that --disk-dir, in
    the same process, was refused as "in use by another cache"."""
    config = CacheConfig(memory_budget_bytes=4 * MIB, disk_dir=tmp_path / "disk",
                         disk_budget_bytes=64 * MIB)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(BindError):
            await create_cache_server(config, f"127.0.0.1:{taken.getsockname()[1]}")
    _, _, cache = await create_cache_server(config, "127.0.0.1:0")
    await cache.stop(0)


async def test_sigterm_lets_puts_finish_and_serves_metrics(tmp_path, processes) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    # The bandwidth limit keeps the 16 MiB put in flight for about a second,
    # and the signal goes only once it has started: no fixed sleep decides
    # whether SIGTERM lands before, during or after it.
    process = start_cache_process("--memory-budget", "64MiB", "--metrics-port",
                                  str(metrics_port), "--grace", "60",
                                  "--bandwidth-limit", "16MiB")
    processes.append(process)
    data = make_payload(LAYOUT, 4 * NUM_BLOCKS)  # 16 MiB
    async with CacheClient(process.address) as client:
        await client.put("before", LAYOUT, NUM_BLOCKS, 0, data[: 4 * MIB])
        text = await asyncio.to_thread(scrape, metrics_port)
        assert "kvstash_cache_puts_total 1.0" in text
        assert "kvstash_cache_memory_bytes 4.194304e+06" in text
        put = asyncio.ensure_future(client.put("during", LAYOUT, 4 * NUM_BLOCKS, 0, data))

        async def started() -> bool:
            return (await client.stats()).bytes_in > 4 * MIB

        await wait_until(started, "the second put is sending")
        process.proc.send_signal(15)
        assert await put == 16 * MIB  # in flight when SIGTERM came: finished
    assert await asyncio.to_thread(process.proc.wait, 60) == 0


async def test_pooled_buffers_stay_in_budget_and_go_when_idle(processes) -> None:
    budget = 48 * MIB
    process = start_cache_process("--memory-budget", "48MiB", "--reserve-wait", "60",
                                  "--sweep-interval", "0.2", "--buffer-pool-idle", "1s")
    processes.append(process)
    baseline = process.rss_bytes()
    sizes = [NUM_BLOCKS, 2 * NUM_BLOCKS, NUM_BLOCKS // 2]  # 4, 8 and 2 MiB: pooled, reused,
    async with CacheClient(process.address) as client:   # and released for other sizes
        for round_ in range(4):
            names = [f"r{round_}-{i}" for i in range(8)]
            payloads = [make_payload(LAYOUT, sizes[(round_ + i) % 3], seed=i) for i in range(8)]
            await asyncio.gather(*(client.put(n, LAYOUT, p.nbytes // (32 * 1024), 0, p)
                                   for n, p in zip(names, payloads, strict=True)))
            for n, p in zip(names, payloads, strict=True):
                assert (await client.get(n))[1] == p.tobytes()
                await client.delete(n)
        peak = process.rss_bytes("VmHWM")
        limit = baseline + budget + CacheConfig(memory_budget_bytes=budget).overhead_bytes(8)
        assert peak <= limit, f"peak RSS {peak / MIB:.0f} MiB > {limit / MIB:.0f} MiB"

        # The last round's 40 MiB of freed buffers sit in the pool, unmapped
        # after 1 s idle (what else stays resident is grpc's and malloc's).
        pooled_rss = process.rss_bytes()

        async def trimmed() -> bool:
            return process.rss_bytes() <= pooled_rss - 24 * MIB

        await wait_until(trimmed, "idle pooled buffers are unmapped")
