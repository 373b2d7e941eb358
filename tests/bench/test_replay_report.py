"""bench.replay's oracle comparison, table, JSON and plots, on hand-made runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.replay import report
from bench.replay.drive import Occupancy
from bench.replay.runs import COUNTERS, RunResult
from kvstash.sim.cache import SimCache
from kvstash.sim.cluster import Cluster, instance_configs
from kvstash.sim.profile import DEFAULT_PROFILE, read_profile
from kvstash.workload import plots
from kvstash.workload.metrics import RequestRecord, Slo
from kvstash.workload.trace import synthetic


def run(policy: str, outputs: dict[int, list[int]], rate: float = 1.0) -> RunResult:
    records = [RequestRecord(i, 0.0, [0.1, 0.2], len(out), out, 0.2)
               for i, out in outputs.items()]
    counters = dict.fromkeys(COUNTERS, 0) | {"num_prompt_tokens": 300,
                                             "num_prefix_query_tokens": 300,
                                             "num_prefix_hit_tokens": 75}
    occupancy = [Occupancy(0.1 * i, 10 * i, 64, i, 0, 0, i << 20, 0) for i in range(5)]
    return RunResult(policy, rate, records, counters, occupancy)


def test_the_oracle_names_the_request_and_where_outputs_part() -> None:
    same = [run("recompute", {0: [1, 2, 3], 1: [4]}), run("offload", {0: [1, 2, 3], 1: [4]})]
    assert report.output_mismatches(same) == []
    differ = [*same, run("auto", {0: [1, 9, 3], 1: [4]}, rate=2.0)]
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


def test_replay_json_is_strict_json(tmp_path: Path) -> None:
    """A figure with no value is null, not NaN or Infinity, which JSON has
    not: here one-token outputs (no TPOT) arriving all at once (no rate)."""
    report.write_json(tmp_path / "r.json", [run("recompute", {0: [1], 1: [2]}, rate=math.inf)],
                      Slo(1.0, 0.1), {})

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    body = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert body["runs"][0]["rate"] is None
    assert body["runs"][0]["summary"]["tpot_s"] == {"p50": None, "p90": None, "p99": None}
    assert body["runs"][0]["summary"]["ttft_s"]["p50"] == pytest.approx(0.1)


def test_oracle_reports_outputs_a_run_did_not_produce() -> None:
    """Each request of the slice is accounted for in every run: one a run did
    not complete is named with that run, though the others agree (a policy
    that completed 1 request of 38 passed, found in review)."""
    full = run("recompute", {0: [1, 2], 1: [3, 4], 2: [5, 6]})
    partial = run("offload", {0: [1, 2], 1: [3, 4], 2: [5, 6]})
    partial.records[1].error = "Unavailable"
    partial.records[2].ended_s = None  # its stream ended without a finish
    assert report.output_mismatches([full, partial]) == [
        "request 1: not completed in offload @ 1/s (Unavailable), so not compared with "
        "recompute @ 1/s",
        "request 2: not completed in offload @ 1/s (UNFINISHED), so not compared with "
        "recompute @ 1/s"]
    assert report.output_mismatches([partial, full])[0] == \
        "request 1: not completed in offload @ 1/s (Unavailable), so not compared with " \
        "recompute @ 1/s"
    # Not completed anywhere: nothing was compared.
    full.records[1].error = "Unavailable"
    assert report.output_mismatches([full, partial])[0] == \
        "request 1: completed in no run, its output went unchecked"
    assert report.output_mismatches([partial]) == [
        "request 1: completed in no run, its output went unchecked",
        "request 2: completed in no run, its output went unchecked"]
    # A run that holds no record of a request did not complete it either.
    assert report.output_mismatches([run("recompute", {0: [1]}), run("offload", {1: [2]})]) == [
        "request 0: not completed in offload @ 1/s (not sent), so not compared with "
        "recompute @ 1/s",
        "request 1: not completed in recompute @ 1/s (not sent), so not compared with "
        "offload @ 1/s"]
    assert report.output_mismatches([run("recompute", {0: [1]})]) == []


def test_prefix_hit_rate_is_a_share_even_after_recompute_preemptions() -> None:
    """The scheduler core (in the simulator) under KV pressure, recompute
    only: a preempted request readmitted with its prompt still cached hits
    again; that hit counts against the tokens it looked up again, so the
    rate stays a share (hits over prompt + recomputed tokens went past 1)."""
    profile = read_profile(DEFAULT_PROFILE)
    trace = synthetic(12, rate=50.0, input_mean=20, output_mean=150, shared_blocks=2, seed=0,
                      block_tokens=64)
    cluster = Cluster(instance_configs("recompute", 1, num_blocks=24, block_size=16,
                                       max_model_len=2048, max_num_seqs=16,
                                       max_num_batched_tokens=512,
                                       bytes_per_block=profile.bytes_per_block),
                      profile, SimCache(1 << 30, 0))
    c = cluster.run(trace).counters
    assert c["num_preemptions_recompute"] > 0
    assert c["num_prefix_hit_tokens"] > c["num_prompt_tokens"] + c["num_recomputed_tokens"]
    rate = report.prefix_hit_rate(c)
    assert 0 < rate <= 1
    # Every admission looks up its tokens: at least each prompt once.
    assert c["num_prefix_query_tokens"] >= sum(r.input_length for r in trace.requests)
