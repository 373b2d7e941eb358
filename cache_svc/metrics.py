"""The cache's Prometheus metrics: gauges and counters read from the store's
stats at scrape time (so they can never drift from what GetStats reports),
and histograms of transfer durations observed by the gRPC edge."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

from cache_svc.model import CacheStats
from cache_svc.store import SnapshotStore
from kvstash.common.metrics import TRANSFER_BUCKETS, MetricsServer, StatsCollector
from kvstash.common.stats import declared

_PREFIX = "kvstash_cache_"


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
        StatsCollector(_PREFIX, store.stats, asyncio.get_running_loop(), declared(CacheStats)))
    return MetricsServer(registry, port, addr)
