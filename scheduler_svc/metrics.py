"""The scheduler's Prometheus metrics, named like vLLM's and SGLang's with the
`kvstash_scheduler_` prefix.

Queue, pool, token and preemption figures, and the rates the preemption cost
model learned, are read from the core at scrape time, so they cost the step
loop nothing. Per-request histograms are observed once per request when its
Generate call ends (`observe_finished`), copy durations once per offload or
restore (`offload_s`, `restore_s`), P/D handoffs once each (`handoff_s`),
preemptions by mode and reason once each (`observe_preemption`) and
prefix-tier lookups once per request (`observe_lookup`), by the engine:
never per token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvstash.common.metrics import TRANSFER_BUCKETS, MetricsServer, StatsCollector
from kvstash.common.stats import Kind, Stat, declared
from scheduler_svc.core.config import PreemptionMode
from scheduler_svc.core.costs import CostEstimates
from scheduler_svc.core.outputs import Preempted, PreemptReason, SchedulerStats
from scheduler_svc.core.request import RequestStatus, RequestUsage
from scheduler_svc.core.scheduler import Scheduler

_PREFIX = "kvstash_scheduler_"


def _gauge(name: str, doc: str) -> Stat:
    """A gauge read from a snapshot's attribute `name` that GetStats does not carry."""
    return Stat(name, Kind.GAUGE, doc, name, float)


# Every figure of GetStats (declared with SchedulerStats), and one derived from them.
_STATS = (
    *declared(SchedulerStats),
    _gauge("kv_usage_ratio", "Share of KV blocks held by requests (neither free nor evictable)"),
)
# Fields of the core's CostEstimates, exported with the unit spelled out as
# Prometheus names it (`_seconds`, never `_s`); NaN until measured.
_COST_GAUGES = tuple(Stat(name, Kind.GAUGE, doc, metric, float) for name, (metric, doc) in {
    "offload_s_fixed": ("offload_fixed_seconds", "Learned fixed seconds of one offload"),
    "offload_s_per_block": ("offload_seconds_per_block",
                            "Learned seconds per KV block offloaded"),
    "restore_s_fixed": ("restore_fixed_seconds", "Learned fixed seconds of one restore"),
    "restore_s_per_block": ("restore_seconds_per_block",
                            "Learned seconds per KV block restored"),
    "prefill_s_per_token": ("prefill_seconds_per_token",
                            "Learned prefill seconds per token (a in a*L + b*L^2)"),
    "prefill_s_per_token_squared": ("prefill_seconds_per_token_squared",
                                    "Learned prefill seconds per token squared (b)"),
    "crossover_tokens": ("crossover_tokens", "Context length above which AUTO predicts "
                         "offload cheaper than recompute"),
}.items())
# (mode, reason) of every preemption the core can choose.
_PREEMPTIONS = (
    (PreemptionMode.OFFLOAD, PreemptReason.FORCED),
    (PreemptionMode.RECOMPUTE, PreemptReason.FORCED),
    (PreemptionMode.OFFLOAD, PreemptReason.CHEAPER),
    (PreemptionMode.RECOMPUTE, PreemptReason.CHEAPER),
    (PreemptionMode.OFFLOAD, PreemptReason.NO_ESTIMATE),
    (PreemptionMode.RECOMPUTE, PreemptReason.CACHE_UNAVAILABLE),
    (PreemptionMode.OFFLOAD, PreemptReason.REMEASURE),
)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The finish_reason a client sees (an error ends a request as aborted).
_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class SchedulerMetrics:
    def __init__(self, core: Scheduler, loop: asyncio.AbstractEventLoop) -> None:
        self.registry = r = CollectorRegistry()
        r.register(StatsCollector(_PREFIX, core.stats, loop, _STATS))
        r.register(StatsCollector(_PREFIX + "cost_", lambda: _nan_if_none(core.cost_estimates()),
                                  loop, _COST_GAUGES))

        def latency(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(_PREFIX + name, doc, buckets=buckets, registry=r)

        self.queue_time_s = latency("queue_time_seconds", "Arrival to first scheduled",
                                    _LATENCY_BUCKETS)
        self.ttft_s = latency("ttft_seconds", "Arrival to first token", _LATENCY_BUCKETS)
        self.tpot_s = latency("time_per_output_token_seconds",
                              "Mean time between output tokens of a finished request",
                              _LATENCY_BUCKETS)
        self.e2e_s = latency("e2e_request_latency_seconds",
                             "Arrival to the end of the request, any reason", _LATENCY_BUCKETS)
        self.offload_s = latency("offload_seconds", "Command to commit of one successful offload",
                                 TRANSFER_BUCKETS)
        self.restore_s = latency("restore_seconds",
                                 "Command to completion of one successful restore",
                                 TRANSFER_BUCKETS)
        self.handoff_s = latency(
            "handoff_seconds", "P/D: first token sampled to the decode instance's first token",
            TRANSFER_BUCKETS)
        self.prefix_load_s = latency(
            "prefix_tier_load_seconds", "Command to completion of one prefix-tier load "
            "(all its segments)", TRANSFER_BUCKETS)
        lookups = Counter(_PREFIX + "prefix_tier_lookups",
                          "Requests whose prompt segments the prefix tier was asked for, by "
                          "whether it held the first (hit, miss; unanswered: the cache did "
                          "not answer)", ["result"], registry=r)
        self._lookups = {result: lookups.labels(result)
                         for result in ("hit", "miss", "unanswered")}
        found = Counter(_PREFIX + "prefix_tier_found_segments",
                        "Leading prompt segments the prefix tier held at arrival, by tier",
                        ["tier"], registry=r)
        self._found = {tier: found.labels(tier) for tier in ("memory", "disk")}
        finished = Counter(_PREFIX + "finished_requests_by_reason",
                           "Requests finished, by finish_reason", ["reason"], registry=r)
        self._finished = {status: finished.labels(reason) for status, reason in _REASONS.items()}
        preemptions = Counter(_PREFIX + "preemptions", "Preemptions by mode and reason",
                              ["mode", "reason"], registry=r)
        self._preemptions = {(mode, reason): preemptions.labels(mode.value, reason.value)
                             for mode, reason in _PREEMPTIONS}

    def observe_lookup(self, tiers: list[str] | None) -> None:
        """A lookup found the leading segments in these tiers (memory, disk);
        None: the cache did not answer, which says nothing of what it holds."""
        if tiers is None:
            self._lookups["unanswered"].inc()
            return
        self._lookups["hit" if tiers else "miss"].inc()
        for tier in tiers:
            self._found[tier].inc()

    def observe_preemption(self, choice: Preempted) -> None:
        self._preemptions[choice.mode, choice.reason].inc()

    def observe_finished(
        self, status: RequestStatus | None, usage: RequestUsage | None, arrival: float,
        ttft_s: float,
    ) -> None:
        """A Generate call the core accepted ended: `arrival` and `ttft_s` are
        the edge's, on time.monotonic(); the queue time is the core's. `usage`
        is None only for a request its worker's failure ended after the core
        had already let it go."""
        if status is not None and (counter := self._finished.get(status)) is not None:
            counter.inc()
        self.e2e_s.observe(time.monotonic() - arrival)
        if usage is None:
            return
        if usage.queue_time_s is not None:
            self.queue_time_s.observe(usage.queue_time_s)
        if not ttft_s:
            return
        self.ttft_s.observe(ttft_s)
        if usage.num_output_tokens > 1:
            self.tpot_s.observe(
                (time.monotonic() - arrival - ttft_s) / (usage.num_output_tokens - 1))

    def serve(self, port: int, host: str) -> MetricsServer:
        return MetricsServer(self.registry, port, host)


def _nan_if_none(estimates: CostEstimates) -> SimpleNamespace:
    """A gauge has a value: NaN (unknown) where the core has None."""
    values = {f.name: getattr(estimates, f.name) for f in dataclasses.fields(estimates)}
    return SimpleNamespace(**{k: math.nan if v is None else v for k, v in values.items()})
