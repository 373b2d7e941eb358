"""What the budgets charge a snapshot: its bytes in whole pages (a mapping's,
an arena extent's, a file's with its head and checksum trailer), and at most
max_snapshots of them listed, so that many small snapshots cannot take more
memory or disk than the budgets say (they took 4.8 KiB of memory and 4.1 KiB
of disk each while charged 4 bytes)."""

from __future__ import annotations

import pytest
from cache_helpers import MIB, make_layout, start_cache_process

from cache_svc.config import ENTRY_BYTES, CacheConfig
from cache_svc.disk import file_bytes
from cache_svc.model import PAGE_BYTES, pages
from cache_svc.snapshot import SnapshotMeta
from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient

# The smallest valid layout: 4 bytes a block (1 layer, K and V, one token,
# one head of one float16).
TINY = make_layout(num_layers=1, block_size=1, num_kv_heads=1, head_dim=1)
TINY_META = SnapshotMeta("t", TINY, num_blocks=1, num_tokens=1, total_bytes=4, chunk_bytes=MIB,
                         pinned=True, ttl_s=60)


def test_a_snapshot_is_charged_its_pages() -> None:
    assert [pages(n) for n in (1, PAGE_BYTES, PAGE_BYTES + 1)] == [
        PAGE_BYTES, PAGE_BYTES, 2 * PAGE_BYTES]


async def test_tiny_snapshots_fill_the_memory_budget_by_their_pages(processes) -> None:
    """A 4 MiB budget takes 1,024 snapshots of 4 bytes, a page each, then
    refuses; the process stays within budget + overhead (60,000 of them
    were taken before, and 280 MiB)."""
    budget, inflight, rpcs = 4 * MIB, 12 * MIB, 8
    process = start_cache_process(
        "--memory-budget", str(budget), "--max-inflight", str(inflight),
        "--max-concurrent-rpcs", str(rpcs), "--buffer-pool", "0")
    processes.append(process)
    baseline = process.rss_bytes()
    config = CacheConfig(memory_budget_bytes=budget, max_inflight_bytes=inflight,
                         max_concurrent_rpcs=rpcs)
    fit = budget // PAGE_BYTES
    async with CacheClient(process.address, chunk_bytes=MIB, use_arena=False) as client:
        for i in range(fit):
            await client.put(f"t{i}", TINY, 1, 1, bytes(4))
        with pytest.raises(errors.ResourceExhausted, match="need 4096 bytes of memory, 0 free"):
            await client.put("one-more", TINY, 1, 1, bytes(4))
        stats = await client.stats()
    assert (stats.memory_snapshots, stats.memory_bytes) == (fit, budget)
    assert process.rss_bytes() <= baseline + budget + config.overhead_bytes()


async def test_tiny_snapshots_fill_the_disk_budget_by_their_files(start_cache) -> None:
    """Spilled, each is charged its file (a 4 KiB head, 4 bytes, an 8-byte
    checksum) in pages: the files on disk stay within the disk budget."""
    charge = pages(file_bytes(TINY_META))
    assert charge == 2 * PAGE_BYTES
    running = await start_cache(memory_budget_bytes=4 * MIB, disk_budget_bytes=10 * charge)
    for i in range(4 * MIB // PAGE_BYTES):  # a full memory tier
        await running.client.put(f"t{i}", TINY, 1, 1, bytes(4))
    # Ten pages wanted: ten snapshots spill and fill the disk budget, then one
    # page more can go nowhere (all pinned): refused.
    await running.client.put("big", TINY, 10 * PAGE_BYTES // 4, 0, bytes(10 * PAGE_BYTES))
    with pytest.raises(errors.ResourceExhausted, match="0 disk bytes free"):
        await running.client.put("one-more", TINY, 1, 1, bytes(4))
    stats = await running.client.stats()
    assert (stats.disk_snapshots, stats.disk_bytes) == (10, 10 * charge)
    on_disk = sum(p.stat().st_size for p in running.disk_dir.iterdir())
    assert on_disk <= stats.disk_budget_bytes
    running.cache.store.check_integrity()


async def test_max_snapshots_evicts_the_oldest_unpinned_then_refuses(start_cache) -> None:
    running = await start_cache(max_snapshots=8)
    client = running.client
    for i in range(10):
        await client.put(f"u{i}", TINY, 1, 1, bytes(4), pinned=False)
    stats = await client.stats()
    assert (stats.memory_snapshots, stats.num_evictions) == (8, 2)
    for name in ("u0", "u1"):  # the least recently used went
        with pytest.raises(errors.NotFound):
            await client.stat(name)
    for i in range(8):  # pinned puts displace the unpinned ones
        await client.put(f"p{i}", TINY, 1, 1, bytes(4))
    with pytest.raises(errors.ResourceExhausted, match=r"lists 8 snapshots .*--max-snapshots"):
        await client.put("p8", TINY, 1, 1, bytes(4))
    stats = await client.stats()
    assert (stats.memory_snapshots, stats.num_evictions, stats.num_refused) == (8, 10, 1)
    # Their bookkeeping is in the bound on resident memory, a snapshot at a time.
    assert (CacheConfig(max_snapshots=9).overhead_bytes()
            - CacheConfig(max_snapshots=8).overhead_bytes()) == ENTRY_BYTES
    running.cache.store.check_integrity()


async def test_a_restart_under_a_smaller_max_snapshots_gets_back_within_it(
        start_cache) -> None:
    """Four files on disk, restarted with max_snapshots 3: the oldest unpinned
    goes at start; a put at the cap then evicts as many as it needs (one
    each time, so a listing over the cap stayed over for good)."""
    layout = make_layout()  # 32 KiB blocks
    running = await start_cache(memory_budget_bytes=4 * MIB, unpinned_share=1.0)
    for i in range(8):  # 1 MiB each: u0..u3 go to disk
        await running.client.put(f"u{i}", layout, 32, 0, bytes(MIB), pinned=False)
    await running.cache.stop(0)
    running = await start_cache(memory_budget_bytes=4 * MIB, unpinned_share=1.0,
                                max_snapshots=3)
    stats = await running.client.stats()
    assert (stats.disk_snapshots, stats.num_evictions) == (3, 1)
    with pytest.raises(errors.NotFound):
        await running.client.stat("u0")
    await running.client.put("n", layout, 1, 0, bytes(32 * 1024), pinned=False)
    stats = await running.client.stats()
    assert stats.memory_snapshots + stats.disk_snapshots == 3
    running.cache.store.check_integrity()
