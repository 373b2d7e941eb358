"""The cache's /metrics endpoint: bound to the configured address only,
exporting every declared stat, and serving transfer durations and bytes per
tier with values that match what happened."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import MIB, make_layout, make_payload, on_disk

from cache_svc.__main__ import build_parser, config_from_args
from cache_svc.config import CacheConfig
from cache_svc.metrics import TransferMetrics, serve_metrics
from cache_svc.model import CacheStats
from cache_svc.store import SnapshotStore
from kvstash.common import settings
from kvstash.common.binding import free_port
from kvstash.common.stats import Kind, declared
from tests.metrics_helpers import scrape
from tests.stats_helpers import count_distinct

LAYOUT = make_layout()  # 32 KiB blocks
NUM_BLOCKS = 128  # 4 MiB


async def test_endpoint_binds_the_chosen_host_and_reports_transfers(start_cache) -> None:
    port = free_port()
    running = await start_cache(memory_budget_bytes=4 * MIB, disk_budget_bytes=64 * MIB,
                                metrics_port=port, metrics_host="127.0.0.1")
    data = make_payload(LAYOUT, NUM_BLOCKS)
    await running.client.put("a", LAYOUT, NUM_BLOCKS, 0, data)
    await running.client.put("b", LAYOUT, NUM_BLOCKS, 0, data)  # spills "a" to disk
    out = np.zeros_like(data)
    await running.client.get_into("a", memoryview(out))
    assert out.tobytes() == data.tobytes()

    m = await asyncio.to_thread(scrape, port)
    assert m["kvstash_cache_put_seconds_count"] == 2
    assert m["kvstash_cache_get_seconds_count"] == 1
    for kind in ("put", "get"):
        assert 0 < m[f"kvstash_cache_{kind}_seconds_sum"] < 60
    assert m["kvstash_cache_memory_bytes"] == 4 * MIB
    assert m["kvstash_cache_disk_bytes"] == on_disk(1)
    assert m["kvstash_cache_bytes_in_total"] == 8 * MIB
    assert m["kvstash_cache_bytes_out_total"] == 4 * MIB
    # Bound to the chosen address only: another loopback address is refused.
    with pytest.raises(OSError):
        await asyncio.to_thread(scrape, port, "127.0.0.2")


async def test_every_declared_stat_is_exported_under_its_metric(tmp_path: Path) -> None:
    store = SnapshotStore(CacheConfig(memory_budget_bytes=4 * MIB, disk_dir=tmp_path,
                                      disk_budget_bytes=8 * MIB))
    count_distinct(store._counters)
    port = free_port()
    server = serve_metrics(store, TransferMetrics(), port, "127.0.0.1")
    try:
        m = await asyncio.to_thread(scrape, port)
    finally:
        server.stop()
        await store.close()
    stats = store.stats()
    exported = {f"kvstash_cache_{s.metric}" + ("_total" if s.kind is Kind.COUNTER else ""):
                getattr(stats, s.name) for s in declared(CacheStats)}
    assert {name: m[name] for name in exported} == exported


def test_metrics_host_comes_from_flag_or_environment() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args([])).metrics_host == "127.0.0.1"
    args = settings.parse_args(build_parser(), "cache", [],
                               environ={"KVSTASH_CACHE_METRICS_HOST": "0.0.0.0"})
    assert config_from_args(args).metrics_host == "0.0.0.0"
    args = settings.parse_args(build_parser(), "cache", ["--metrics-host", "::1"],
                               environ={"KVSTASH_CACHE_METRICS_HOST": "0.0.0.0"})
    assert config_from_args(args).metrics_host == "::1"


@pytest.mark.parametrize("host", ["", "not a host", "a/b", "x" * 300])
def test_bad_metrics_host_is_refused(host: str) -> None:
    with pytest.raises(ValueError, match="metrics_host") as caught:
        CacheConfig(metrics_host=host)
    assert len(str(caught.value)) < 200
