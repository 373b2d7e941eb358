"""What a replay measured, request by request, and the summary of a run.

Times are time.perf_counter seconds as the client saw them; "sent" is
when the request was due (its arrival in the trace), so a client that sends
late counts the wait, as a server's queue would be counted:

    sent        first chunk      chunk  ...  last chunk (finish)
     |--- TTFT ---|-- ITL --|-- ITL --|...|
                  |----- TPOT x (tokens - 1) -----|
     |------------------- end to end -------------|

A chunk is one streamed message carrying tokens (it may carry several).
Goodput is requests per second that completed within every SLO (TTFT <= a,
TPOT <= b; a request of one token has no TPOT and meets that one), over the
run's wall time, from the first request sent to the last one ended.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    index: int  # in the trace slice
    sent_s: float  # when it was due to be sent: its arrival
    chunk_times: list[float] = field(default_factory=list)  # of chunks with tokens
    num_tokens: int = 0
    output: list[int] | str = field(default_factory=list)  # token ids, or text (HTTP)
    ended_s: float | None = None
    error: str | None = None  # a gRPC status / HTTP error name; None: completed

    @property
    def ok(self) -> bool:
        return self.error is None and self.ended_s is not None and bool(self.chunk_times)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.sent_s if self.chunk_times else None

    @property
    def tpot_s(self) -> float | None:
        if self.num_tokens < 2 or len(self.chunk_times) < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.num_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def e2e_s(self) -> float | None:
        return None if self.ended_s is None else self.ended_s - self.sent_s


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be > 0 s, got TTFT {self.ttft_s}, TPOT {self.tpot_s}")

    def met(self, record: RequestRecord) -> bool:
        ttft, tpot = record.ttft_s, record.tpot_s
        return record.ok and ttft is not None and ttft <= self.ttft_s \
            and (tpot is None or tpot <= self.tpot_s)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def spread(values: Sequence[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in PERCENTILES}


@dataclass(frozen=True, slots=True)
class Summary:
    num_requests: int
    num_completed: int
    num_failed: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    goodput: float  # requests/s within every SLO
    attainment: float  # share of all requests within every SLO
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    itl_s: dict[str, float]
    e2e_s: dict[str, float]
    errors: dict[str, int]  # error name -> count


def summarize(records: Sequence[RequestRecord], slo: Slo) -> Summary:
    if not records:
        raise ValueError("no requests to summarize")
    done = [r for r in records if r.ok]
    ends = [r.ended_s for r in records if r.ended_s is not None]
    wall = max(ends) - min(r.sent_s for r in records) if ends else 0.0
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            name = r.error or "UNFINISHED"  # the stream ended without a finish
            errors[name] = errors.get(name, 0) + 1
    num_met = sum(slo.met(r) for r in records)

    def per_s(count: float) -> float:
        return count / wall if wall > 0 else 0.0

    return Summary(
        num_requests=len(records), num_completed=len(done), num_failed=len(records) - len(done),
        wall_s=wall, requests_per_s=per_s(len(done)),
        output_tokens_per_s=per_s(sum(r.num_tokens for r in done)),
        goodput=per_s(num_met), attainment=num_met / len(records),
        ttft_s=spread([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_s=spread([r.tpot_s for r in done if r.tpot_s is not None]),
        itl_s=spread([gap for r in done for gap in r.itls_s]),
        e2e_s=spread([r.e2e_s for r in done if r.e2e_s is not None]),
        errors=errors,
    )


def median_run(summaries: Sequence[Summary]) -> Summary:
    """Of several runs of one setting, the one whose SLO attainment is the
    median (the lower middle of an even count)."""
    return sorted(summaries, key=lambda s: s.attainment)[(len(summaries) - 1) // 2]


# Figures spread_text shows: name, how a Summary gives it, its format.
SPREAD_FIGURES: tuple[tuple[str, Callable[[Summary], float], str], ...] = (
    ("goodput", lambda s: s.goodput, "{:.3f}"), ("SLO", lambda s: s.attainment, "{:.0%}"),
    ("TTFT p50", lambda s: s.ttft_s["p50"], "{:.3f}"),
    ("TTFT p99", lambda s: s.ttft_s["p99"], "{:.3f}"),
    ("TPOT p50", lambda s: s.tpot_s["p50"], "{:.4f}"))


def spread_text(summaries: Sequence[Summary]) -> str:
    """Several runs' median (min-max) of each of SPREAD_FIGURES."""
    parts = []
    for name, figure, form in SPREAD_FIGURES:
        values = sorted(map(figure, summaries))
        middle = statistics.median(values)
        parts.append(f"{name} {form.format(middle)} "
                     f"({form.format(values[0])}-{form.format(values[-1])})")
    return ", ".join(parts)


def strict(value: Any) -> Any:
    """`value` with each float that is not finite as None (null): JSON has no
    NaN (a percentile of no values) or inf (the rate of arrivals all at once)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value
