"""SLO and goodput arithmetic on hand-made timings."""

from __future__ import annotations

import pytest

from kvstash.workload.metrics import (
    RequestRecord,
    Slo,
    median_run,
    percentile,
    spread_text,
    summarize,
)


def record(index: int, sent: float, chunks: list[float], tokens: int | None = None,
           error: str | None = None) -> RequestRecord:
    return RequestRecord(index, sent, list(chunks), len(chunks) if tokens is None else tokens,
                         [index] * len(chunks), chunks[-1] if chunks else None, error)


def test_one_requests_latencies() -> None:
    r = record(0, 10.0, [10.5, 10.6, 10.8, 11.1], tokens=5)  # one chunk carried two tokens
    assert r.ok and r.ttft_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx(0.6 / 4)
    assert r.itls_s == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e_s == pytest.approx(1.1)
    one = record(1, 0.0, [0.2])
    assert one.tpot_s is None and one.itls_s == []


def test_goodput_counts_requests_within_every_slo_over_the_wall_time() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    records = [
        record(0, 0.0, [0.5, 0.55, 0.6]),          # meets both
        record(1, 1.0, [2.5, 2.55]),               # TTFT 1.5 s: misses
        record(2, 2.0, [2.2, 2.7, 3.2]),           # TPOT 0.5 s: misses
        record(3, 3.0, [3.9]),                     # one token: no TPOT, meets
        record(4, 3.0, [], error="ResourceExhausted"),
        record(5, 4.0, [4.1, 4.2], error="FINISH_ABORT"),  # failed: never meets
    ]
    s = summarize(records, slo)
    assert (s.num_requests, s.num_completed, s.num_failed) == (6, 4, 2)
    assert s.wall_s == pytest.approx(4.2)  # first sent 0.0, last ended 4.2
    assert s.requests_per_s == pytest.approx(4 / 4.2)
    assert s.output_tokens_per_s == pytest.approx((3 + 2 + 3 + 1) / 4.2)
    assert s.goodput == pytest.approx(2 / 4.2)
    assert s.attainment == pytest.approx(2 / 6)
    assert s.errors == {"ResourceExhausted": 1, "FINISH_ABORT": 1}
    assert s.ttft_s["p50"] == pytest.approx(percentile([0.5, 1.5, 0.2, 0.9], 50))
    with pytest.raises(ValueError, match="> 0"):
        Slo(0.0, 1.0)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0


def test_a_run_where_nothing_ended_has_no_wall_time() -> None:
    s = summarize([record(0, 100.0, [], error="Unavailable")], Slo(1.0, 0.1))
    assert (s.wall_s, s.goodput, s.requests_per_s, s.attainment) == (0.0, 0.0, 0.0, 0.0)


def test_the_median_run_and_the_spread_of_several() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=1.0)
    # Runs of two requests whose TTFTs put 0, 1 or 2 of them within the SLO.
    runs = [summarize([record(0, 0.0, [ttft]), record(1, 0.0, [0.5])], slo)
            for ttft in (2.0, 0.2, 3.0)]
    assert [r.attainment for r in runs] == [0.5, 1.0, 0.5]
    assert median_run(runs) in (runs[0], runs[2]) and median_run(runs).attainment == 0.5
    assert median_run(runs[:2]) is runs[0]  # an even count: the lower middle
    text = spread_text(runs)
    assert "SLO 50% (50%-100%)" in text
    assert "TTFT p50 1.250 (0.350-1.750)" in text
