"""The scheduler's Prometheus metrics: queue, pool and preemption counters from
the core's stats at scrape time, plus latency histograms observed per request."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

from kvstash.metrics import MetricsServer, StatsCollector
from scheduler_svc.scheduler import Scheduler

_GAUGES = {
    "num_total_blocks": "KV blocks in the pool",
    "num_free_blocks": "KV blocks never used or fully released",
    "num_evictable_blocks": "Cached prefix blocks nobody holds (reclaimed LRU)",
    "num_running_prefill": "Requests computing their prompt",
    "num_running_decode": "Requests generating",
    "num_waiting": "Requests queued for (re)prefill",
    "num_offloaded": "Requests offloading, offloaded or resuming",
    "new_token_ratio": "Share of each decode request's remaining tokens reserved at admission",
}
_COUNTERS = {
    "preemptions_offload": ("num_preemptions_offload", "Preemptions that stashed KV"),
    "preemptions_recompute": ("num_preemptions_recompute", "Preemptions that dropped KV"),
    "offload_failures": ("num_offload_failures", "Offloads that failed (fell back to recompute)"),
    "restore_failures": ("num_restore_failures", "Restores that failed (fell back to recompute)"),
    "recomputed_tokens": ("num_recomputed_tokens", "Tokens prefilled again after preemption"),
    "finished_requests": ("num_finished", "Requests finished, any reason"),
    "offloaded_bytes": ("bytes_offloaded", "KV bytes stashed in the cache service"),
    "restored_bytes": ("bytes_restored", "KV bytes brought back from the cache service"),
    "steps": ("num_steps", "Engine steps scheduled"),
}
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class SchedulerMetrics:
    """Histograms the gRPC edge observes; exported with the core's counters."""

    def __init__(self, core: Scheduler, loop: asyncio.AbstractEventLoop) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(
            StatsCollector("kvstash_scheduler_", core.stats, loop, _GAUGES, _COUNTERS))
        self.ttft_s = Histogram("kvstash_scheduler_ttft_seconds", "Arrival to first token",
                                buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot_s = Histogram("kvstash_scheduler_time_per_output_token_seconds",
                                "Mean time between output tokens of a finished request",
                                buckets=_LATENCY_BUCKETS, registry=self.registry)

    def serve(self, port: int) -> MetricsServer:
        return MetricsServer(self.registry, port)
