"""The cache's Prometheus metrics, read from the store's stats at scrape time so
they can never drift from what GetStats reports."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from cache_svc.store import SnapshotStore
from kvstash.metrics import MetricsServer, StatsCollector

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


def serve_metrics(store: SnapshotStore, port: int, addr: str = "0.0.0.0") -> MetricsServer:
    """Serves `/metrics` on `port`; call from the event loop that owns `store`."""
    registry = CollectorRegistry()
    registry.register(
        StatsCollector(_PREFIX, store.stats, asyncio.get_running_loop(), _GAUGES, _COUNTERS))
    return MetricsServer(registry, port, addr)
