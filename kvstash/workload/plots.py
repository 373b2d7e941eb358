"""PNG plots of runs (replayed: bench.replay; simulated: kvstash sim): latency
CDFs per policy, goodput and SLO attainment against the request rate, KV-pool
and cache-tier occupancy over time. Figures are made without pyplot: no global
state, no display. matplotlib is an extra (pip install 'kvstash[bench]')."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from kvstash.workload.metrics import RequestRecord, Slo, summarize

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Run:
    """What the plots need of one run."""

    policy: str
    rate: float  # mean arrivals/s
    records: Sequence[RequestRecord]
    times_s: Sequence[float] = ()  # occupancy samples: when,
    pool_used: Sequence[float] = ()  # the share of the KV pool held by requests [0, 1],
    tier_bytes: Sequence[int] = ()  # and the cache tier's bytes, memory + disk


def _finish(fig: Figure, axes: tuple[Axes, ...], title: str, path: Path) -> None:
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # none where nothing completed
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _cdf(ax: Axes, values: Sequence[float], name: str) -> None:
    ordered = sorted(values)
    if ordered:
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post",
                label=name)


def latency_cdfs(runs: Sequence[Run], slo: Slo, path: Path, title: str) -> None:
    fig = Figure(figsize=(11, 4))
    ttft, tpot = fig.subplots(1, 2)
    for run in runs:
        done = [r for r in run.records if r.ok]
        _cdf(ttft, [r.ttft_s for r in done if r.ttft_s is not None], run.policy)
        _cdf(tpot, [1000 * r.tpot_s for r in done if r.tpot_s is not None], run.policy)
    ttft.axvline(slo.ttft_s, color="grey", linestyle="--", label="SLO")
    tpot.axvline(1000 * slo.tpot_s, color="grey", linestyle="--", label="SLO")
    ttft.set(xlabel="TTFT (s)", ylabel="share of requests", xscale="log")
    tpot.set(xlabel="TPOT (ms)", ylabel="share of requests")
    _finish(fig, (ttft, tpot), title, path)


def goodput_by_rate(runs: Sequence[Run], slo: Slo, path: Path, title: str) -> None:
    fig = Figure(figsize=(11, 4))
    good, met = fig.subplots(1, 2)
    for policy in dict.fromkeys(run.policy for run in runs):
        mine = sorted((r for r in runs if r.policy == policy), key=lambda r: r.rate)
        summaries = [summarize(r.records, slo) for r in mine]
        rates = [r.rate for r in mine]
        good.plot(rates, [s.goodput for s in summaries], marker="o", label=policy)
        met.plot(rates, [100 * s.attainment for s in summaries], marker="o", label=policy)
    met.axhline(90, color="grey", linestyle="--", label="90%")
    good.set(xlabel="request rate (req/s)", ylabel="goodput (req/s within SLOs)")
    met.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    _finish(fig, (good, met), title, path)


def occupancy(runs: Sequence[Run], path: Path, title: str) -> None:
    fig = Figure(figsize=(11, 4))
    pool, tier = fig.subplots(1, 2)
    for run in runs:
        if run.times_s:
            pool.plot(run.times_s, [100 * u for u in run.pool_used], label=run.policy)
            tier.plot(run.times_s, [b / MIB for b in run.tier_bytes], label=run.policy)
    pool.set(xlabel="time (s)", ylabel="KV pool held by requests (%)", ylim=(0, 105))
    tier.set(xlabel="time (s)", ylabel="cache tier, memory + disk (MiB)")
    _finish(fig, (pool, tier), title, path)
