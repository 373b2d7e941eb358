"""bench.sim_vs_replay end to end on the tiny model: a real P/D stack (a
prefill and a decode instance, real processes) beside its simulation, every
figure in the table, the hand-offs counted on both sides, the real steps
timed against the profile from the prefill scheduler's own record, and the
simulation run again on jittered arrivals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replay.runs import RunResult
from bench.sim_vs_replay import FIGURES, as_served, main
from kvstash.workload.metrics import RequestRecord
from kvstash.workload.trace import Trace, TraceRequest


def test_a_pd_slice_is_replayed_and_simulated_side_by_side(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--synthetic", "6", "--rates", "2", "--synthetic-input", "64",
                 "--synthetic-output", "8", "--model", "tiny", "--policies", "offload",
                 "--num-blocks", "256", "--pd", "--sim-runs", "3",
                 "--json", str(tmp_path / "runs.json")]) == 0
    rows = {" ".join(line.split()[2:-7]): line.split()[-7:]
            for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == set(FIGURES)
    real, _, sim, sim_range, _, pair, pair_error = rows["hand-offs"]
    # Every request decoded on the decode instance, in every jittered run
    # too, and in the run simulated as it was served.
    assert float(real) == float(sim) == float(pair) == 6 and pair_error == "+0%"
    assert sim_range == "6.000-6.000"
    _, _, sim, sim_range, _, pair, _ = rows["TTFT p50"]
    low, high = map(float, sim_range.split("-"))
    assert 0 < low <= float(sim) <= high and float(pair) > 0
    real, _, sim, _, _, pair, _ = rows["step s/profile"]
    # The tiny model's steps against the llama-small profile: far quicker.
    assert 0 < float(real) < 1 and float(sim) == float(pair) == 1
    [point] = json.loads((tmp_path / "runs.json").read_text())
    assert len(point["real"]) == len(point["paired"]) == 1 and len(point["sim"]) == 3
    assert point["sim"][0][FIGURES.index("hand-offs")] == 6


@pytest.mark.parametrize(("bad", "says"), [
    ('{"timestamp": 0, "input_length": 5}\n', "t.jsonl:1: missing output_length, hash_ids"),
    ("", "no requests"),
])
def test_a_bad_trace_is_a_clear_error_before_any_stack_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str, says: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(bad, encoding="utf-8")
    assert main(["--trace", str(trace), "--model", "tiny"]) == 2
    assert says in capsys.readouterr().err


def test_a_max_context_beyond_the_pool_is_refused_before_any_stack_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--synthetic", "4", "--model", "tiny", "--num-blocks", "4",
                 "--max-context", "65"]) == 2
    assert "--max-context 65 is more than an instance serves: 64 tokens" in \
        capsys.readouterr().err


def test_a_run_as_served_arrives_when_its_scheduler_added_each_request() -> None:
    """The record's adds, by prompt, in their order; the warm-up (added before
    the slice started, its prompt the first one's first tokens, here all of
    it) is none of them; a request the stack refused keeps its own arrival."""
    trace = Trace((TraceRequest(0.0, 4, 2, (0,)), TraceRequest(0.5, 6, 2, (1,)),
                   TraceRequest(0.6, 6, 2, (2,))), 16)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 11]]
    start = 100.0  # the client's clock when the slice started
    run = RunResult("offload", 2.0, [RequestRecord(i, start + r.arrival_s)
                                     for i, r in enumerate(trace.requests)], {}, [])
    lines = [{"op": "config", "t": 90.0},
             {"op": "add", "t": 99.0, "prompt": prompts[0][:8]},  # the warm-up
             {"op": "add", "t": 100.002, "prompt": prompts[0]},
             {"op": "add", "t": 100.705, "prompt": prompts[1]}]  # request 2: refused
    served, due = as_served(trace, prompts, run, lines)
    assert [round(r.arrival_s, 3) for r in served.requests] == [0.002, 0.6, 0.705]
    assert [r.input_length for r in served.requests] == [4, 6, 6]
    assert due == [0.0, 0.6, 0.5]
    late = [{**line, "t": line["t"] - 0.3} if line["t"] > 100.5 else line for line in lines]
    with pytest.raises(SystemExit, match="clocks differ"):
        as_served(trace, prompts, run, late)  # request 1 added before it was due
