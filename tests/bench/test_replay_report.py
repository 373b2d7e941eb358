"""bench.replay's oracle comparison, table, JSON and plots, on hand-made runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replay import report
from bench.replay.drive import Occupancy
from bench.replay.runs import COUNTERS, RunResult
from kvstash.workload import plots
from kvstash.workload.metrics import RequestRecord, Slo


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
    plotted = [r.plotted() for r in runs]
    plots.latency_cdfs(plotted[:2], slo, tmp_path / "cdf.png", "t")
    plots.goodput_by_rate(plotted, slo, tmp_path / "goodput.png", "t")
    plots.occupancy(plotted[:2], tmp_path / "occ.png", "t")
    for name in ("cdf.png", "goodput.png", "occ.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_oracle_fails_where_it_compared_nothing() -> None:
    failed = run("offload", {0: [1, 2]})
    failed.records[0].error = "FINISH_ABORT"
    assert report.output_mismatches([run("recompute", {0: [1, 2]}), failed]) == [
        "offload @ 1/s: no request completed, its outputs went unchecked"]
    assert report.output_mismatches([failed]) == [
        "offload @ 1/s: no request completed, its outputs went unchecked"]
    # Each run completed requests, but no request completed in two of them.
    assert report.output_mismatches([run("recompute", {0: [1]}), run("offload", {1: [2]})]) == [
        "no request completed in two runs: no output was compared"]
    assert report.output_mismatches([run("recompute", {0: [1]})]) == []
