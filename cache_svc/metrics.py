"""The cache's Prometheus metrics: gauges and counters read from the store's
stats at scrape time (so they can never drift from what GetStats reports),
and histograms of transfer durations observed by the gRPC edge."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

from cache_svc.store import SnapshotStore
from kvstash.metrics import TRANSFER_BUCKETS, MetricsServer, StatsCollector

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
    "consumed": ("num_consumed", "Snapshots deleted by the get that consumed them"),
    "shared_puts": ("num_shared_puts", "Of the puts, those through the shared-memory arena"),
    "shared_gets": ("num_shared_gets", "Of the gets, those through the shared-memory arena"),
    "bytes_in": ("bytes_in", "Chunk payload bytes received"),
    "bytes_out": ("bytes_out", "Chunk payload bytes sent"),
}


class TransferMetrics:
    """Durations of completed transfers, in their own registry (one per server,
    so servers in one process do not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.put_seconds = Histogram(
            _PREFIX + "put_seconds", "Duration of completed puts: header, waiting for "
            "room, chunks, commit", registry=self.registry, buckets=TRANSFER_BUCKETS)
        self.get_seconds = Histogram(
            _PREFIX + "get_seconds", "Duration of completed gets: header and every chunk "
            "sent", registry=self.registry, buckets=TRANSFER_BUCKETS)


def serve_metrics(
    store: SnapshotStore, transfers: TransferMetrics, port: int, addr: str
) -> MetricsServer:
    """Serves `/metrics` on `addr`:`port`; call from the event loop that owns `store`."""
    registry = transfers.registry
    registry.register(
        StatsCollector(_PREFIX, store.stats, asyncio.get_running_loop(), _GAUGES, _COUNTERS))
    return MetricsServer(registry, port, addr)
