"""A small PromQL evaluator over scrapes of /metrics: no Prometheus runs
here, and the dashboard's and alert rules' queries must be checked against
what the services really export (tests/integration/test_dashboard.py) and
drawn from a real run (bench.dashboard_snapshot).

Parsing is promql-parser's (the Rust PromQL parser, in a wheel); evaluation
covers what those queries use, with Prometheus's semantics for it:
selectors with every matcher kind (5 minutes of lookback), `rate`,
`increase`, `irate`, `deriv`, `delta`, `histogram_quantile`, `clamp_min`,
`clamp_max`, `sum`/`avg`/`min`/`max`/`count` by or without labels,
arithmetic and comparisons between scalars and vectors (one-to-one and
many-to-one matching, `on`/`ignoring`, `bool`), `and`/`or`/`unless`.
Anything else is a ValueError naming it. Unlike Prometheus, `rate` does not
extrapolate to the window's edges: over sparse scrapes it is the mean slope
between the first and last sample in the window. (What a query uses: the
dashboard's helpers, bench.dashboard_snapshot.)

    series = Series()
    series.add(time.time(), text, {"pod": "a", "job": "scheduler"})  # each scrape
    series.query('sum by (mode) (rate(kvstash_scheduler_preemptions_total[1m]))', t)
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from collections import defaultdict
from collections.abc import Callable, Mapping

import promql_parser as pq
from prometheus_client.parser import text_string_to_metric_families

LOOKBACK_S = 300.0
Labels = tuple[tuple[str, str], ...]  # sorted, __name__ included for raw series
Vector = list[tuple[dict[str, str], float]]
Value = Vector | float

_ARITH: dict[str, Callable[[float, float], float]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul,
    "/": lambda a, b: a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a)),
}
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le,
    "==": operator.eq, "!=": operator.ne,
}
_AGGREGATE: dict[str, Callable[[list[float]], float]] = {
    "sum": sum, "min": min, "max": max, "count": len, "avg": lambda v: sum(v) / len(v),
}


class Series:
    """Every sample of every scrape, by series."""

    def __init__(self) -> None:
        self.points: dict[Labels, list[tuple[float, float]]] = defaultdict(list)

    def add(self, t: float, text: str, target: Mapping[str, str]) -> None:
        """One scrape of a /metrics page at time `t`, its series given the
        target's labels (as a scrape config would: job, pod, ...)."""
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {**sample.labels, **target, "__name__": sample.name}
                self.points[tuple(sorted(labels.items()))].append((t, float(sample.value)))

    def names(self) -> set[str]:
        return {dict(key)["__name__"] for key in self.points}

    def labels_of(self, name: str) -> set[str]:
        return {label for key in self.points if dict(key)["__name__"] == name
                for label, _ in key} - {"__name__"}

    def query(self, query: str, t: float) -> Value:
        """The query's value at time `t`: an instant vector or a scalar."""
        return self._eval(pq.parse(query), t)

    def _select(self, selector: pq.VectorSelector, start: float, end: float
                ) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        if selector.offset is not None or selector.at is not None:
            raise ValueError("offset and @ are not supported")
        wanted = [(m.name, m.op, m.value) for m in selector.matchers.matchers]
        if selector.name:
            wanted.append(("__name__", pq.MatchOp.Equal, selector.name))
        found = []
        for key, points in self.points.items():
            labels = dict(key)
            if all(_matches(labels.get(name, ""), op, value) for name, op, value in wanted):
                window = [(ts, v) for ts, v in points if start < ts <= end]
                if window:
                    found.append((labels, window))
        return found

    def _eval(self, node: object, t: float) -> Value:
        if isinstance(node, pq.NumberLiteral):
            return float(node.val)
        if isinstance(node, pq.ParenExpr):
            return self._eval(node.expr, t)
        if isinstance(node, pq.UnaryExpr):
            return _binary("*", -1.0, self._eval(node.expr, t), None)
        if isinstance(node, pq.VectorSelector):
            return [(labels, points[-1][1])
                    for labels, points in self._select(node, t - LOOKBACK_S, t)]
        if isinstance(node, pq.Call):
            return self._call(node, t)
        if isinstance(node, pq.AggregateExpr):
            return _aggregate(node, _vector(self._eval(node.expr, t)))
        if isinstance(node, pq.BinaryExpr):
            return _binary(str(node.op), self._eval(node.lhs, t), self._eval(node.rhs, t),
                           node.modifier)
        raise ValueError(f"unsupported PromQL: {node}")

    def _call(self, node: pq.Call, t: float) -> Value:
        name, args = node.func.name, list(node.args)
        if name in _RANGE_FUNCTIONS:
            matrix = args[0]
            if not isinstance(matrix, pq.MatrixSelector):
                raise ValueError(f"{name} needs a range selector, got {matrix}")
            seconds = matrix.range.total_seconds()
            out = []
            for labels, points in self._select(matrix.vector_selector, t - seconds, t):
                value = _RANGE_FUNCTIONS[name](points, seconds)
                if value is not None:
                    out.append((_drop_name(labels), value))
            return out
        if name == "histogram_quantile":
            return _histogram_quantile(_scalar(self._eval(args[0], t)),
                                       _vector(self._eval(args[1], t)))
        if name in ("clamp_min", "clamp_max"):
            bound, pick = _scalar(self._eval(args[1], t)), max if name == "clamp_min" else min
            return [(_drop_name(labels), pick(v, bound))
                    for labels, v in _vector(self._eval(args[0], t))]
        raise ValueError(f"unsupported PromQL function {name}")


def _matches(value: str, op: pq.MatchOp, pattern: str) -> bool:
    if op == pq.MatchOp.Equal:
        return value == pattern
    if op == pq.MatchOp.NotEqual:
        return value != pattern
    hit = re.fullmatch(pattern, value) is not None
    return hit if op == pq.MatchOp.Re else not hit


def _increase(points: list[tuple[float, float]]) -> float:
    """A counter's rise over the points, across resets."""
    total = 0.0
    for (_, before), (_, after) in itertools.pairwise(points):
        total += after - before if after >= before else after
    return total


def _rate(points: list[tuple[float, float]], _range: float) -> float | None:
    span = points[-1][0] - points[0][0]
    return _increase(points) / span if len(points) > 1 and span > 0 else None


def _deriv(points: list[tuple[float, float]], _range: float) -> float | None:
    """Least-squares slope, per second."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(ts for ts, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    spread = sum((ts - mean_t) ** 2 for ts, _ in points)
    return (sum((ts - mean_t) * (v - mean_v) for ts, v in points) / spread) if spread else None


_RANGE_FUNCTIONS: dict[str, Callable[[list[tuple[float, float]], float], float | None]] = {
    "rate": _rate,
    "increase": lambda p, r: None if (rate := _rate(p, r)) is None else rate * r,
    "irate": lambda p, r: _rate(p[-2:], r),
    "deriv": _deriv,
    "delta": lambda p, _r: p[-1][1] - p[0][1] if len(p) > 1 else None,
}


def _drop_name(labels: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k != "__name__"}


def _vector(value: Value) -> Vector:
    if isinstance(value, float):
        raise ValueError("expected a vector, got a scalar")
    return value


def _scalar(value: Value) -> float:
    if not isinstance(value, float):
        raise ValueError("expected a scalar, got a vector")
    return value


def _aggregate(node: pq.AggregateExpr, vector: Vector) -> Vector:
    op = str(node.op)
    if op not in _AGGREGATE:
        raise ValueError(f"unsupported PromQL aggregation {op}")
    modifier = node.modifier
    groups: dict[Labels, list[float]] = defaultdict(list)
    for labels, value in vector:
        if modifier is None:
            kept: dict[str, str] = {}
        elif modifier.type == pq.AggModifierType.By:
            kept = {k: v for k, v in labels.items() if k in modifier.labels}
        else:
            kept = {k: v for k, v in _drop_name(labels).items() if k not in modifier.labels}
        groups[tuple(sorted(kept.items()))].append(value)
    return [(dict(key), _AGGREGATE[op](values)) for key, values in groups.items()]


def _signature(labels: Mapping[str, str], modifier: pq.BinModifier | None) -> Labels:
    matching = None if modifier is None else modifier.matching
    plain = _drop_name(labels)
    if matching is None:
        return tuple(sorted(plain.items()))
    if matching.type == pq.LabelModifierType.Include:  # on (...)
        return tuple(sorted((k, v) for k, v in plain.items() if k in matching.labels))
    return tuple(sorted((k, v) for k, v in plain.items() if k not in matching.labels))


def _binary(op: str, lhs: Value, rhs: Value, modifier: pq.BinModifier | None) -> Value:
    if isinstance(lhs, float) and isinstance(rhs, float):
        if op in _COMPARE:
            return float(_COMPARE[op](lhs, rhs))
        return _ARITH[op](lhs, rhs)
    if op in ("and", "or", "unless"):
        return _set_op(op, _vector(lhs), _vector(rhs), modifier)
    as_bool = modifier is not None and modifier.return_bool
    out: Vector = []
    if isinstance(rhs, float):
        for labels, value in _vector(lhs):
            out.extend(_combine(op, labels, value, rhs, value, as_bool))
        return out
    if isinstance(lhs, float):
        for labels, value in rhs:
            out.extend(_combine(op, labels, lhs, value, value, as_bool))
        return out
    by_signature = {_signature(labels, modifier): value for labels, value in rhs}
    for labels, value in lhs:
        other = by_signature.get(_signature(labels, modifier))
        if other is not None:
            out.extend(_combine(op, labels, value, other, value, as_bool))
    return out


def _combine(op: str, labels: Mapping[str, str], a: float, b: float, kept: float,
             as_bool: bool) -> Vector:
    """One sample of a vector operation: arithmetic drops the metric name; a
    comparison keeps the sample (`kept`) where it holds, or gives 0/1 with bool."""
    if op in _ARITH:
        return [(_drop_name(labels), _ARITH[op](a, b))]
    if op not in _COMPARE:
        raise ValueError(f"unsupported PromQL operator {op}")
    if as_bool:
        return [(_drop_name(labels), float(_COMPARE[op](a, b)))]
    return [(dict(labels), kept)] if _COMPARE[op](a, b) else []


def _set_op(op: str, lhs: Vector, rhs: Vector, modifier: pq.BinModifier | None) -> Vector:
    right = {_signature(labels, modifier) for labels, _ in rhs}
    if op == "and":
        return [(labels, v) for labels, v in lhs if _signature(labels, modifier) in right]
    if op == "unless":
        return [(labels, v) for labels, v in lhs if _signature(labels, modifier) not in right]
    left = {_signature(labels, modifier) for labels, _ in lhs}
    return lhs + [(labels, v) for labels, v in rhs if _signature(labels, modifier) not in left]


def _histogram_quantile(q: float, buckets: Vector) -> Vector:
    """Prometheus's: linear within the bucket the rank falls in; NaN where
    nothing was observed; the highest finite bound where it falls in +Inf."""
    groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for labels, count in buckets:
        if "le" in labels:
            rest = {k: v for k, v in _drop_name(labels).items() if k != "le"}
            groups[tuple(sorted(rest.items()))].append((float(labels["le"]), count))
    out = []
    for key, counts in groups.items():
        counts.sort()
        total = counts[-1][1]
        if total <= 0 or not math.isinf(counts[-1][0]):
            out.append((dict(key), math.nan))
            continue
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, count in counts:
            if count >= rank:
                if math.isinf(bound):
                    value = lower
                else:
                    value = lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
                break
            lower, below = bound, count
        out.append((dict(key), value))
    return out
