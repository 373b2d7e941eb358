"""bench.replay end to end: a small synthetic trace replayed through real
stacks (processes, sockets), under KV pressure, per policy and through smg."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bench.replay.__main__ as replay_main
from bench.replay.__main__ import main
from bench.replay.runs import COUNTERS, RunResult
from kvstash.common.binding import free_port
from kvstash.launch.stack import StackConfig, running_stack
from kvstash.workload.metrics import RequestRecord
from kvstash.workload.trace import Trace
from tests.gpu_worker.worker_factories import REPO
from tests.process_helpers import as_at_a_terminal, cmdline_of, descendant_pids, is_running

# Lengths as drawn x 1/16: 8 requests at once, prompts ~80 tokens (a
# 32-token system prompt shared), ~96 output tokens each: ~12 blocks apiece
# at the end, 32 in the pool, and admission reserving for a tenth of the
# outputs: running decodes outgrow the pool and are preempted.
PRESSURE = ["--synthetic", "8", "--rates", "50", "--synthetic-input", "768",
            "--synthetic-output", "1536", "--length-scale", "0.0625", "--num-blocks", "32",
            "--max-num-seqs", "8", "--cache-memory-budget", "64MiB", "--seed", "1",
            "--scheduler-args", "--init-new-token-ratio 0.1"]


def runs_of(out: Path) -> dict[str, dict]:  # type: ignore[type-arg]
    body = json.loads((out / "replay.json").read_text())
    return {run["policy"]: run for run in body["runs"]}


def test_replay_under_pressure_offload_recomputes_nothing(tmp_path: Path) -> None:
    assert main([*PRESSURE, "--policies", "recompute,offload", "--out", str(tmp_path)]) == 0
    runs = runs_of(tmp_path)
    for run in runs.values():
        assert run["summary"]["num_completed"] == 8, run["summary"]
        assert all(r["num_tokens"] > 0 and r["error"] is None for r in run["requests"])
        assert run["occupancy"] and max(o["used_blocks"] for o in run["occupancy"]) > 0
    recompute, offload = runs["recompute"]["counters"], runs["offload"]["counters"]
    assert recompute["num_preemptions_recompute"] > 0 and recompute["num_recomputed_tokens"] > 0
    assert offload["num_preemptions_offload"] > 0 and offload["num_recomputed_tokens"] == 0
    assert offload["bytes_restored"] == offload["bytes_offloaded"] > 0
    # Both tokens and prefix hits are what the requests asked for.
    assert recompute["num_generation_tokens"] == offload["num_generation_tokens"]
    assert offload["num_prefix_hit_tokens"] > 0
    for name in ("latency_cdf.png", "occupancy.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_replay_through_smg_gives_the_grpc_outputs(tmp_path: Path) -> None:
    args = ["--synthetic", "4", "--rates", "20", "--synthetic-input", "40",
            "--synthetic-output", "6", "--length-scale", "0.0625", "--policies", "offload"]
    assert main([*args, "--out", str(tmp_path / "grpc")]) == 0
    assert main([*args, "--via", "http", "--out", str(tmp_path / "http")]) == 0
    grpc_run = runs_of(tmp_path / "grpc")["offload"]
    http_run = runs_of(tmp_path / "http")["offload"]
    assert http_run["summary"]["num_completed"] == 4
    assert [r["num_tokens"] for r in http_run["requests"]] == \
        [r["num_tokens"] for r in grpc_run["requests"]]


def test_a_bad_trace_is_refused_before_any_stack_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5}\n', encoding="utf-8")
    assert main(["--trace", str(trace), "--out", str(tmp_path)]) == 2
    assert "t.jsonl:1: missing output_length, hash_ids" in capsys.readouterr().err


@pytest.mark.parametrize(("bad", "says"), [
    (["--synthetic", "1", "--rates", "2"], "at once"),
    (["--synthetic", "4", "--max-context", "1"], "no request fits"),
])
def test_a_slice_that_cannot_be_fitted_is_refused_before_any_stack_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: list[str], says: str) -> None:
    assert main([*bad, "--out", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("bad", [
    ["--length-scale", "0"], ["--length-scale", "inf"], ["--output-scale", "inf"],
    ["--time-scale", "nan"], ["--rates", "inf"], ["--block-tokens", "0"],
])
def test_a_scale_that_is_not_finite_and_positive_is_refused_by_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: list[str]) -> None:
    """Not an OverflowError from round(inf), not a replay of NaN arrivals."""
    with pytest.raises(SystemExit) as done:
        main(["--synthetic", "4", *bad, "--out", str(tmp_path)])
    assert done.value.code == 2
    assert f"{bad[0]} must be" in capsys.readouterr().err


@pytest.mark.parametrize(("bad", "says"), [
    (["--scheduler-args=--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--cache-memory-budget", "lots"], "not a byte size: 'lots'"),
    (["--model", "no-such-model"], "is not"),
])
def test_a_stack_that_will_not_start_is_one_error_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: list[str], says: str) -> None:
    """The flags that reach the services are theirs to refuse: that refusal
    (a service's exit, its log's last lines) ended the replay in a traceback."""
    assert main(["--synthetic", "2", "--rates", "2", "--synthetic-input", "40",
                 "--synthetic-output", "4", "--length-scale", "0.0625", "--policies", "offload",
                 *bad, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err  # after the run's progress bar
    assert any(line.startswith("error: ") for line in err.splitlines()) and says in err, err


def test_against_a_running_stack_the_default_max_context_is_its_pool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--address: the running stack's pool (4 blocks of 16 here), not
    --num-blocks', decides what is too long to serve; a request kept longer
    would only be refused. A stack not there is refused before any replay."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": n, "output_length": 4,
                                         "hash_ids": list(range(n // 16 + 1))}) + "\n"
                             for n in (30, 90, 60)), encoding="utf-8")
    seen: list[tuple[int | None, int]] = []

    def replay_all(args: argparse.Namespace, base: StackConfig,
                   fitted: list[tuple[Trace, int]]) -> list[RunResult]:
        seen.append((args.max_context, fitted[0][1]))
        return [RunResult("external", 1.0, [RequestRecord(0, 0.0, [0.1], 1, [1], 0.1)],
                          dict.fromkeys(COUNTERS, 0), [])]

    monkeypatch.setattr(replay_main, "replay_all", replay_all)
    flags = ["--trace", str(trace), "--block-tokens", "16", "--out", str(tmp_path / "o")]
    with running_stack(StackConfig(num_blocks=4), tmp_path) as stack:
        assert main([*flags, "--address", stack.address]) == 0
    assert seen == [(64, 1)]
    assert main([*flags, "--address", f"127.0.0.1:{free_port('127.0.0.1')}"]) == 2
    assert "error: " in capsys.readouterr().err and seen == [(64, 1)]


def test_ctrl_c_stops_the_replay_and_its_stack_in_one_line(tmp_path: Path) -> None:
    """SIGINT while a stack serves the replay: its services stop, its
    arena and data directories go, and it says so in one line with 130
    (it was a traceback out of asyncio)."""
    tmp = tmp_path / "tmp"  # where it makes its data, logs and checkpoint directories
    tmp.mkdir()
    replay = subprocess.Popen(as_at_a_terminal([
        sys.executable, "-m", "bench.replay", "--synthetic", "40", "--rates", "2",
        "--synthetic-input", "40", "--synthetic-output", "6", "--length-scale", "0.0625",
        "--policies", "recompute,offload", "--out", str(tmp_path / "out")]),
        cwd=REPO, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    assert replay.stderr is not None
    started: list[int] = []
    arenas: set[str] = set()
    try:
        seen = []
        for line in replay.stderr:  # tqdm's \r ends a line here too
            seen.append(line)
            if "| 1/40" in line:  # a request served: the stack is up
                break
        assert "| 1/40" in "".join(seen), "".join(seen)
        started = descendant_pids(replay.pid)
        assert any("scheduler_svc" in cmdline_of(pid) for pid in started), started
        for pid in started:
            maps = Path(f"/proc/{pid}/maps")
            arenas |= {line.split()[-1] for line in maps.read_text().splitlines()
                       if "/kvstash-arena-" in line} if maps.exists() else set()
        replay.send_signal(signal.SIGINT)
        rest = replay.communicate(timeout=120)[1]
        assert "Traceback" not in rest, rest
        assert rest.strip().splitlines()[-1] == "python -m bench.replay: stopped (its stacks " \
            "with it)", rest
        assert replay.returncode == 130
        deadline = time.monotonic() + 30
        while any(map(is_running, started)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [cmdline_of(pid) for pid in started if is_running(pid)]
        assert arenas and not [a for a in arenas if Path(a).exists()], arenas
        assert [p.name for p in tmp.iterdir()] == []
    finally:
        for pid in [replay.pid, *started]:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
        replay.wait()
