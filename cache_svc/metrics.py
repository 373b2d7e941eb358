"""Prometheus metrics, read from the store's stats at scrape time so they can
never drift from what GetStats reports."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cache_svc.model import CacheStats
from cache_svc.store import SnapshotStore

_PREFIX = "kvstash_cache_"
_GAUGES = {
    "memory_bytes": "Bytes held by the memory tier",
    "memory_budget_bytes": "Memory tier budget in bytes",
    "memory_snapshots": "Snapshots in the memory tier",
    "disk_bytes": "Bytes held by the disk tier",
    "disk_budget_bytes": "Disk tier budget in bytes",
    "disk_snapshots": "Snapshots in the disk tier",
    "pinned_bytes": "Bytes of pinned snapshots, both tiers",
    "reserved_bytes": "Bytes reserved by puts in progress",
    "free_bytes": "Bytes a new put can still reserve, both tiers",
}
_COUNTERS = {
    "puts": ("num_puts", "Completed puts"),
    "gets": ("num_gets", "Gets started"),
    "refused_puts": ("num_refused", "Puts refused for capacity"),
    "failed_puts": ("num_failed_puts", "Puts aborted: bad chunk, checksum, cancellation"),
    "evictions": ("num_evictions", "Unpinned snapshots evicted under pressure"),
    "spills": ("num_spills", "Snapshots spilled from memory to disk"),
    "expired": ("num_expired", "Snapshots deleted after their TTL"),
    "bytes_in": ("bytes_in", "Chunk payload bytes received"),
    "bytes_out": ("bytes_out", "Chunk payload bytes sent"),
}


class StatsCollector:
    def __init__(self, store: SnapshotStore, loop: asyncio.AbstractEventLoop) -> None:
        self._store = store
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        # Scrapes run on the HTTP server's thread; the store belongs to the
        # event loop, so the stats are taken there.
        stats: CacheStats = asyncio.run_coroutine_threadsafe(
            _stats(self._store), self._loop
        ).result(timeout=5)
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(_PREFIX + name, doc, value=getattr(stats, name))
        for name, (field, doc) in _COUNTERS.items():
            yield CounterMetricFamily(_PREFIX + name, doc, value=getattr(stats, field))


async def _stats(store: SnapshotStore) -> CacheStats:
    return store.stats()


class Metrics:
    def __init__(self, registry: CollectorRegistry, http_server: Any) -> None:
        self.registry = registry
        self._http_server = http_server

    @classmethod
    def serve(cls, store: SnapshotStore, port: int, addr: str = "0.0.0.0") -> Metrics:
        registry = CollectorRegistry()
        registry.register(StatsCollector(store, asyncio.get_running_loop()))  # type: ignore[arg-type]
        http_server, _thread = start_http_server(port, addr=addr, registry=registry)
        return cls(registry, http_server)

    def stop(self) -> None:
        self._http_server.shutdown()
        self._http_server.server_close()
