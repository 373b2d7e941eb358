"""SLO and goodput arithmetic of bench.replay on hand-made timings, the
oracle's comparison, the table, the JSON and the plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replay import plots, report
from bench.replay.drive import Occupancy
from bench.replay.runs import COUNTERS, RunResult
from kvstash.workload.metrics import RequestRecord, Slo, percentile, summarize


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


def run(policy: str, outputs: dict[int, list[int]], rate: float = 1.0) -> RunResult:
    records = [RequestRecord(i, 0.0, [0.1, 0.2], len(out), out, 0.2)
               for i, out in outputs.items()]
    counters = dict.fromkeys(COUNTERS, 0) | {"num_prompt_tokens": 300,
                                             "num_prefix_hit_tokens": 75}
    occupancy = [Occupancy(0.1 * i, 10 * i, 64, i, 0, 0, i << 20, 0) for i in range(5)]
    return RunResult(policy, rate, records, counters, occupancy)


def test_the_oracle_names_the_request_and_where_outputs_part() -> None:
    same = [run("recompute", {0: [1, 2, 3], 1: [4]}), run("offload", {0: [1, 2, 3], 1: [4]})]
    assert report.output_mismatches(same) == []
    differ = [*same, run("auto", {0: [1, 9, 3]}, rate=2.0)]
    assert report.output_mismatches(differ) == [
        "request 0: auto @ 2/s differs from recompute @ 1/s from output position 1"]


def test_table_json_and_plots(tmp_path: Path) -> None:
    runs = [run("recompute", {0: [1, 2]}), run("offload", {0: [1, 2]}),
            run("recompute", {0: [1, 2]}, rate=2.0)]
    slo = Slo(1.0, 0.5)
    text = report.table(runs, slo)
    header, _, *rows = text.splitlines()
    assert "prefix hit %" in header and len(rows) == 3
    assert [row.split()[:2] for row in rows] == [["recompute", "1"], ["offload", "1"],
                                                 ["recompute", "2"]]
    assert report.prefix_hit_rate(runs[0].counters) == pytest.approx(0.25)
    report.write_json(tmp_path / "r.json", runs, slo, {"model": "tiny"})
    body = json.loads((tmp_path / "r.json").read_text())
    assert body["runs"][1]["policy"] == "offload"
    assert body["runs"][0]["summary"]["goodput"] == pytest.approx(1 / 0.2)
    assert len(body["runs"][0]["occupancy"]) == 5
    plots.latency_cdfs(runs[:2], slo, tmp_path / "cdf.png", "t")
    plots.goodput_by_rate(runs, slo, tmp_path / "goodput.png", "t")
    plots.occupancy(runs[:2], tmp_path / "occ.png", "t")
    for name in ("cdf.png", "goodput.png", "occ.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
