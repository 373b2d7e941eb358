"""The Grafana dashboard and the alert rules against a real stack: P/D
instances, the cache and smg in front, each serving /metrics, a workload
that preempts on the decode instance; every endpoint scraped each second
from before it to its end, and every query evaluated over those scrapes
(bench.promql)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator

import pytest

from bench.dashboard_snapshot import (
    ALL,
    Scraper,
    alert_rules,
    dashboard_queries,
    expand,
    labels_used,
    metric_names,
    pressure,
    pressured_stack,
    quantities,
    scrape,
    targets,
    variable_queries,
)
from bench.promql import Series, Value
from kvstash.launch.openai_http import stream_completion
from kvstash.launch.stack import running_stack

# Labels a Kubernetes scrape adds (the chart's ServiceMonitors), not the services.
TARGET_LABELS = {"job", "pod", "kvstash_io_role"}
WINDOW = "5m"  # $__rate_interval: every scrape falls inside it


@pytest.fixture(scope="module")
def scraped() -> Iterator[tuple[Series, float]]:
    series = Series()
    with running_stack(pressured_stack()) as stack:
        assert len(targets(stack)) == 6  # 2 schedulers, 2 workers, the cache, smg
        # As Prometheus would: from before the load, every second through it.
        scraper = Scraper(stack, series, 1.0, [])
        try:
            asyncio.run(pressure(stack, 24, 64))
        finally:
            scraper.stop()
        # Traffic goes on, as Prometheus scrapes on: smg exports its HTTP
        # counter once its first responses went, often all in one interval
        # at the load's end, which rate() cannot see rise; one more request
        # between two more scrapes makes it.
        scrape(stack, series)
        assert stack.gateway is not None
        asyncio.run(stream_completion(stack.gateway.url, {
            "model": "tiny", "prompt": "one more", "max_tokens": 2}))
        time.sleep(1.0)
        yield series, scrape(stack, series)


def series_of(value: Value) -> list[tuple[dict[str, str], float]]:
    assert not isinstance(value, float), "a panel query gave a scalar"
    return value


def test_every_metric_and_label_the_dashboard_and_rules_use_is_exported(
        scraped: tuple[Series, float]) -> None:
    series, _ = scraped
    queries = [(q.expr, q.legend) for q in dashboard_queries()]
    queries += [(expr, "") for expr in alert_rules().values()]
    queries += [(q.removeprefix("label_values(").rsplit(",", 1)[0], "")
                for q in variable_queries()]
    exported = series.names()
    for expr, legend in queries:
        expanded = expand(expr, {**ALL, "__rate_interval": WINDOW})
        names = metric_names(expanded)
        assert names, expr
        assert names <= exported, f"{expr}: not exported: {names - exported}"
        labels = set().union(*(series.labels_of(n) for n in names)) | TARGET_LABELS
        assert labels_used(expanded, legend) <= labels, (
            f"{expr}: labels not exported: {labels_used(expanded, legend) - labels}")
    for query in variable_queries():
        assert query.rsplit(",", 1)[1].strip(" )") in TARGET_LABELS


def test_every_panel_query_evaluates_to_series_for_every_pool(
        scraped: tuple[Series, float]) -> None:
    series, now = scraped
    for pool in (".*", "prefill", "decode"):
        for query in dashboard_queries():
            if pool != ".*" and "$pool" not in query.expr:
                continue
            expr = expand(query.expr, {**ALL, "pool": pool, "__rate_interval": WINDOW})
            assert series_of(series.query(expr, now)), f"{query.panel} ({pool}): {expr}"


def test_the_panels_show_the_workload(scraped: tuple[Series, float]) -> None:
    """Not only series: the values a preempting P/D run must give."""
    series, now = scraped

    def values(panel: str, legend: str) -> list[float]:
        (query,) = [q for q in dashboard_queries() if q.panel == panel and q.legend == legend]
        expr = expand(query.expr, {**ALL, "__rate_interval": WINDOW})
        return [v for _, v in series_of(series.query(expr, now))]

    assert values("Requests finished by reason", "{{reason}}")
    assert sum(values("Requests finished by reason", "{{reason}}")) > 0
    assert values("Time to first token", "p50")[0] > 0
    assert all(math.isfinite(v) for v in values("Time per output token", "p99"))
    assert values("Preemptions by mode and reason", "{{mode}} ({{reason}})")
    assert sum(values("Preemptions by mode and reason", "{{mode}} ({{reason}})")) > 0
    assert values("Tokens recomputed", "tokens/s") == [0.0]
    assert values("Hand-offs", "handed off")[0] > 0
    assert values("KV blocks", "total")[0] == 2 * 64
    assert values("HTTP responses by status", "{{status_code}}")[0] > 0
    assert math.isfinite(values("smg time to first token and per output token", "TTFT p50")[0])
    decode = expand(next(q.expr for q in dashboard_queries() if q.panel == "KV pool usage"),
                    {**ALL, "pool": "decode", "__rate_interval": WINDOW})
    assert [labels["pod"] for labels, _ in series_of(series.query(decode, now))] == ["decode"]


def test_every_alert_rule_evaluates_and_watches_exported_series(
        scraped: tuple[Series, float]) -> None:
    series, now = scraped
    rules = alert_rules()
    assert {"KvstashKVPoolExhausted", "KvstashPreemptionsRecomputing", "KvstashCacheUnavailable",
            "KvstashCacheRefusingPuts", "KvstashHandoffsFailing"} <= set(rules)
    for name, expr in rules.items():
        fired = series_of(series.query(expr, now))
        assert not fired, f"{name} fires on a healthy stack: {fired}"
        watched = quantities(expr)
        assert watched, name
        for quantity in watched:
            assert series_of(series.query(quantity, now)), f"{name}: {quantity} gives no series"


def test_targets_are_labelled_as_the_chart_labels_them(scraped: tuple[Series, float]) -> None:
    series, _ = scraped
    roles = {dict(key).get("kvstash_io_role") for key in series.points
             if dict(key)["__name__"] == "kvstash_scheduler_num_waiting"}
    assert roles == {"prefill", "decode"}
