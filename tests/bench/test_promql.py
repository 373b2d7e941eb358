"""bench.promql on hand-made scrapes: the values Prometheus gives for them."""

from __future__ import annotations

import math

import pytest

from bench.dashboard_snapshot import expand, metric_names
from bench.promql import Series

FIRST = """\
# TYPE req_total counter
req_total{reason="stop"} 10
req_total{reason="length"} 4
# TYPE lat_seconds histogram
lat_seconds_bucket{le="0.1"} 0
lat_seconds_bucket{le="1.0"} 0
lat_seconds_bucket{le="+Inf"} 0
lat_seconds_count 0
lat_seconds_sum 0
# TYPE usage gauge
usage 0.5
"""
SECOND = """\
# TYPE req_total counter
req_total{reason="stop"} 70
req_total{reason="length"} 4
# TYPE lat_seconds histogram
lat_seconds_bucket{le="0.1"} 50
lat_seconds_bucket{le="1.0"} 100
lat_seconds_bucket{le="+Inf"} 100
lat_seconds_count 100
lat_seconds_sum 30
# TYPE usage gauge
usage 0.9
"""


@pytest.fixture
def series() -> Series:
    s = Series()
    for pod in ("a", "b"):
        s.add(100.0, FIRST, {"pod": pod})
        s.add(130.0, SECOND if pod == "a" else FIRST, {"pod": pod})
    return s


def values(series: Series, query: str, t: float = 130.0) -> dict[tuple[tuple[str, str], ...],
                                                                  float]:
    result = series.query(query, t)
    assert not isinstance(result, float)
    return {tuple(sorted(labels.items())): v for labels, v in result}


def test_rate_and_aggregation(series: Series) -> None:
    assert values(series, "sum by (reason) (rate(req_total[1m]))") == {
        (("reason", "stop"),): 2.0, (("reason", "length"),): 0.0}
    assert values(series, 'increase(req_total{pod="a",reason="stop"}[1m])') == {
        (("pod", "a"), ("reason", "stop")): 120.0}
    assert values(series, "sum(rate(req_total[1m]))") == {(): 2.0}
    assert values(series, "count without (reason) (req_total)") == {
        (("pod", "a"),): 2.0, (("pod", "b"),): 2.0}
    # A window holding one sample gives no rate.
    assert values(series, "rate(req_total[10s])") == {}


def test_histogram_quantile_interpolates_within_the_bucket(series: Series) -> None:
    got = values(series, "histogram_quantile(0.75, sum by (le) (rate(lat_seconds_bucket[1m])))")
    assert got[()] == pytest.approx(0.1 + 0.9 * 0.5)
    # Nothing observed (pod b): NaN, as Prometheus gives.
    (nothing,) = values(series, 'histogram_quantile(0.5, rate(lat_seconds_bucket{pod="b"}[1m]))'
                        ).values()
    assert math.isnan(nothing)


def test_selectors_comparisons_and_matching(series: Series) -> None:
    assert values(series, 'usage{pod=~"a|c"}') == {
        (("__name__", "usage"), ("pod", "a")): 0.9}
    assert values(series, 'usage{pod!~"a"} > 0.4') == {
        (("__name__", "usage"), ("pod", "b")): 0.5}
    assert values(series, "usage > bool 0.6") == {(("pod", "a"),): 1.0, (("pod", "b"),): 0.0}
    assert values(series, "max by (pod) (usage) > 0.6 and on (pod) "
                          "sum by (pod) (rate(req_total[1m])) > 1") == {(("pod", "a"),): 0.9}
    assert values(series, "sum by (pod) (rate(req_total[1m])) / on (pod) max by (pod) (usage)"
                  ) == {(("pod", "a"),): pytest.approx(2 / 0.9), (("pod", "b"),): 0.0}
    assert values(series, "usage unless usage > 0.6") == {
        (("__name__", "usage"), ("pod", "b")): 0.5}
    assert values(series, "deriv(usage[1m])") == {
        (("pod", "a"),): pytest.approx(0.4 / 30), (("pod", "b"),): 0.0}
    assert series.query("1 + 2 * 3", 130.0) == 7.0
    # Five minutes of lookback: after it, a series is gone.
    assert values(series, "usage", t=500.0) == {}


def test_what_it_does_not_evaluate_is_named() -> None:
    with pytest.raises(ValueError, match="unsupported PromQL function predict_linear"):
        Series().query("predict_linear(usage[1m], 60)", 0.0)
    with pytest.raises(ValueError, match="unsupported PromQL aggregation topk"):
        Series().query("topk(3, usage)", 0.0)


def test_variables_and_metric_names() -> None:
    query = expand('rate(x_total{pod=~"$pod"}[$__rate_interval]) / y', {
        "pod": ".*", "__rate_interval": "1m"})
    assert query == 'rate(x_total{pod=~".*"}[1m]) / y'
    assert metric_names(query) == {"x_total", "y"}
