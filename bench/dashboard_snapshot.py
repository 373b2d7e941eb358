"""The Grafana dashboard drawn from a real run, without Grafana: a P/D stack
with smg in front and a KV pool far too small (the demo's pressure), every
/metrics page scraped each `--interval` seconds while requests run, and each
panel's queries evaluated at every scrape (bench.promql) and plotted as the
dashboard lays them out.

Run: python -m bench.dashboard_snapshot [--requests 32] [--out docs/dashboard.png]

Its helpers are also the dashboard test's (tests/integration/test_dashboard.py):
the queries of the dashboard and of the alert rules and what each uses
(metrics, labels, the quantities a rule compares), and a stack's scrape
targets with the labels Kubernetes would give them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import promql_parser as pq
import yaml

from bench.promql import Series
from kvstash.client import Client
from kvstash.launch.demo import make_prompts
from kvstash.launch.openai_http import stream_completion
from kvstash.launch.stack import Stack, StackConfig, running_stack

CHART_FILES = Path(__file__).resolve().parent.parent / "helm" / "kvstash" / "files"
DASHBOARD = CHART_FILES / "grafana-dashboard.json"
RULES = CHART_FILES / "prometheus-rules.yaml"
# What Grafana puts in place of the dashboard's variables: every pool and pod.
ALL = {"pool": ".*", "pod": ".*"}


@dataclass(frozen=True, slots=True)
class Query:
    panel: str
    expr: str
    legend: str


def dashboard_queries(path: Path = DASHBOARD) -> list[Query]:
    board = json.loads(path.read_text())
    return [Query(panel["title"], target["expr"], target.get("legendFormat", ""))
            for panel in board["panels"] for target in panel.get("targets", [])]


def variable_queries(path: Path = DASHBOARD) -> list[str]:
    """The template variables' label_values(...) queries."""
    return [v["query"]["query"] for v in json.loads(path.read_text())["templating"]["list"]
            if v["type"] == "query"]


def alert_rules(path: Path = RULES) -> dict[str, str]:
    """Alert name -> expression."""
    return {rule["alert"]: rule["expr"] for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"]}


def expand(query: str, variables: Mapping[str, str]) -> str:
    """Grafana's `$name` variables replaced (longest names first)."""
    for name in sorted(variables, key=len, reverse=True):
        query = query.replace(f"${name}", variables[name])
    return query


def nodes(query: str) -> Iterator[object]:
    """Every node of the query's syntax tree."""
    stack: list[object] = [pq.parse(query)]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, pq.BinaryExpr):
            stack += [node.lhs, node.rhs]
        elif isinstance(node, pq.AggregateExpr):
            stack += [node.expr] + ([node.param] if node.param is not None else [])
        elif isinstance(node, pq.Call):
            stack += list(node.args)
        elif isinstance(node, (pq.ParenExpr, pq.UnaryExpr)):
            stack.append(node.expr)
        elif isinstance(node, pq.MatrixSelector):
            stack.append(node.vector_selector)


def metric_names(query: str) -> set[str]:
    """Every metric the query selects."""
    return {n.name for n in nodes(query) if isinstance(n, pq.VectorSelector) and n.name}


def labels_used(query: str, legend: str = "") -> set[str]:
    """Every label the query matches, groups or joins on, and those its legend
    names; `le` (a histogram's) left out."""
    found = {part.split("}}")[0] for part in legend.split("{{")[1:]}
    for node in nodes(query):
        if isinstance(node, pq.VectorSelector):
            found.update(m.name for m in node.matchers.matchers)
        elif isinstance(node, pq.AggregateExpr) and node.modifier is not None:
            found.update(node.modifier.labels)
        elif isinstance(node, pq.BinaryExpr) and node.modifier is not None \
                and node.modifier.matching is not None:
            found.update(node.modifier.matching.labels)
    return found - {"le"}


def quantities(query: str) -> list[str]:
    """What a rule compares with a number: the series it watches, which exist
    whether or not it fires."""
    return [node.lhs.prettify() for node in nodes(query)
            if isinstance(node, pq.BinaryExpr) and isinstance(node.rhs, pq.NumberLiteral)
            and str(node.op) in (">", "<", ">=", "<=", "==", "!=")]


def targets(stack: Stack) -> list[tuple[str, dict[str, str]]]:
    """(metrics URL, target labels) of every service, labelled as the
    chart's ServiceMonitors label them: `job`, `pod` (the instance's name),
    `kvstash_io_role` (instances only: mixed, prefill, decode)."""
    pd = stack.decode_scheduler is not None
    found = []
    for service in stack.services:
        url = service.metrics_url
        if url is None:
            raise ValueError(f"{service.name} serves no metrics: start the stack with metrics")
        pod, _, job = service.name.rpartition("-")
        labels = {"job": job, "pod": pod or ("instance0" if job != "cache" else "cache")}
        if job != "cache":
            labels["kvstash_io_role"] = ("decode" if pod == "decode"
                                         else "prefill" if pd else "mixed")
        found.append((url, labels))
    if stack.gateway is not None:
        found.append((stack.gateway.metrics_url, {"job": "gateway", "pod": "gateway"}))
    return found


def scrape(stack: Stack, series: Series, t: float | None = None) -> float:
    """Every target's /metrics into `series`, stamped `t` (default: now)."""
    t = time.time() if t is None else t
    for url, labels in targets(stack):
        with urllib.request.urlopen(url, timeout=10) as reply:
            series.add(t, reply.read().decode(), labels)
    return t


async def pressure(stack: Stack, requests: int, max_tokens: int) -> None:
    """The demo's load: `requests` at once over kvstash's API (the decode
    instance preempts), a quarter as many through smg's OpenAI HTTP."""
    assert stack.gateway is not None
    url = stack.gateway.url
    async with Client(stack.address) as client:
        async def direct(prompt: str) -> None:
            async for _ in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True):
                pass

        prompts = make_prompts(requests)
        await asyncio.gather(
            *(direct(p) for p in prompts),
            *(stream_completion(url, {"model": "tiny", "prompt": p, "max_tokens": max_tokens,
                                      "ignore_eos": True}) for p in prompts[: requests // 4]))


def pressured_stack(num_blocks: int = 64) -> StackConfig:
    return StackConfig(pd=True, gateway=True, metrics=True, num_blocks=num_blocks,
                       max_num_batched_tokens=256)


@dataclass
class Scraper:
    """Scrapes `stack` every `interval` seconds in a thread until stopped."""

    stack: Stack
    series: Series
    interval: float
    times: list[float]

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.times.append(scrape(self.stack, self.series))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def curves(series: Series, query: Query, times: list[float], window: str
           ) -> Iterator[tuple[str, list[float], list[float]]]:
    """(legend, seconds since start, values) of each series the query gives."""
    expr = expand(query.expr, {**ALL, "__rate_interval": window})
    lines: dict[str, tuple[list[float], list[float]]] = {}
    for t in times:
        value = series.query(expr, t)
        for labels, v in ([({}, value)] if isinstance(value, float) else value):
            legend = query.legend
            for name, label in labels.items():
                legend = legend.replace("{{" + name + "}}", label)
            xs, ys = lines.setdefault(legend, ([], []))
            if not math.isnan(v):
                xs.append(t - times[0])
                ys.append(v)
    for legend, (xs, ys) in lines.items():
        yield legend, xs, ys


def draw(series: Series, times: list[float], out: Path, window: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_panel: dict[str, list[Query]] = {}
    for query in dashboard_queries():
        by_panel.setdefault(query.panel, []).append(query)
    columns = 4
    rows = -(-len(by_panel) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.6 * rows))
    for ax, (title, queries) in zip(axes.flat, by_panel.items(), strict=False):
        for query in queries:
            for legend, xs, ys in curves(series, query, times, window):
                ax.plot(xs, ys, label=legend[:28], linewidth=1.2)
        ax.set_title(title[:46], fontsize=9)
        ax.tick_params(labelsize=7)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(by_panel):]:
        ax.axis("off")
    fig.suptitle("kvstash dashboard, drawn from a real run (P/D + smg, tiny model, "
                 "KV pool under pressure); x: seconds", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between scrapes")
    parser.add_argument("--window", default="4s", help="what $__rate_interval becomes")
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = parser.parse_args()
    series, times = Series(), list[float]()
    with running_stack(pressured_stack()) as stack:
        scraper = Scraper(stack, series, args.interval, times)
        try:
            time.sleep(2 * args.interval)
            asyncio.run(pressure(stack, args.requests, args.max_tokens))
            time.sleep(4 * args.interval)
        finally:
            scraper.stop()
    draw(series, times, args.out, args.window)
    print(f"{len(times)} scrapes; wrote {args.out}")


if __name__ == "__main__":
    main()
