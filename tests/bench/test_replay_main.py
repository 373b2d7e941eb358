"""bench.replay's command line with the replays faked: what it exits with
and says."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import bench.replay.__main__ as replay_main
from bench.replay.runs import COUNTERS, RunResult
from kvstash.launch.stack import StackConfig
from kvstash.workload.metrics import RequestRecord
from kvstash.workload.trace import Trace


def write_trace(path: Path, *lengths: tuple[int, int]) -> Path:
    """A request a second of (prompt, output) tokens, an id per 16 prompt tokens."""
    lines, next_id = [], 0
    for n, (inputs, outputs) in enumerate(lengths):
        ids = list(range(next_id, next_id - (-inputs // 16)))
        next_id += len(ids)
        lines.append(json.dumps({"timestamp": 1000 * n, "input_length": inputs,
                                 "output_length": outputs, "hash_ids": ids}) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def make_run(policy: str, outputs: dict[int, list[int]], failed: dict[int, str] | None = None
             ) -> RunResult:
    records = [RequestRecord(i, 0.0, [0.1, 0.2], len(out), out, 0.2)
               for i, out in outputs.items()]
    records += [RequestRecord(i, 0.0, error=error) for i, error in (failed or {}).items()]
    records.sort(key=lambda r: r.index)
    return RunResult(policy, 1.0, records, dict.fromkeys(COUNTERS, 0), [])


def replay(tmp_path: Path, trace: Path, *flags: str) -> int:
    return replay_main.main(["--trace", str(trace), "--block-tokens", "16",
                             "--policies", "recompute,offload", "--out", str(tmp_path / "o"),
                             *flags])


def test_replay_exits_nonzero_when_requests_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A request never fails for lack of memory: any failure is a bug, said
    on stderr with its run and the first errors, not only a table column."""
    trace = write_trace(tmp_path / "t.jsonl", (40, 4), (40, 4), (40, 4), (40, 4), (40, 4))

    def replay_all(args: argparse.Namespace, base: StackConfig,
                   fitted: list[tuple[Trace, int]]) -> list[RunResult]:
        return [make_run("recompute", {0: [1], 1: [2], 2: [3], 3: [4], 4: [5]}),
                make_run("offload", {0: [1]},
                         {1: "Unavailable", 2: "Unavailable", 3: "Internal", 4: "Internal"})]

    monkeypatch.setattr(replay_main, "replay_all", replay_all)
    assert replay(tmp_path, trace) == 1
    said = [line for line in capsys.readouterr().err.splitlines()
            if line.startswith("REQUESTS FAILED")]
    assert said == ["REQUESTS FAILED: offload @ 1/s: 4 of 5 requests failed (request 1 "
                    "Unavailable, request 2 Unavailable, request 3 Internal, ...)"]


def test_default_max_context_drops_what_the_pool_cannot_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The scheduler refuses a request longer than its pool holds, however
    long the model's context: by default the slice drops it rather than
    keeping it to fail (4 blocks of 16 = 64 tokens here, tiny's 1024). A
    --max-context beyond the pool is refused before any stack starts."""
    trace = write_trace(tmp_path / "t.jsonl", (30, 4), (90, 10), (60, 4))
    kept: list[int] = []

    def replay_all(args: argparse.Namespace, base: StackConfig,
                   fitted: list[tuple[Trace, int]]) -> list[RunResult]:
        (slice_, dropped), = fitted
        kept.extend(r.input_length + r.output_length for r in slice_.requests)
        assert (args.max_context, dropped) == (64, 1)
        return [make_run(policy, {0: [1], 1: [2]}) for policy in ("recompute", "offload")]

    monkeypatch.setattr(replay_main, "replay_all", replay_all)
    assert replay(tmp_path, trace, "--num-blocks", "4") == 0
    assert kept == [34, 64]
    assert replay(tmp_path, trace, "--num-blocks", "4", "--max-context", "65") == 2
    assert "--max-context 65 is more than an instance serves: 64 tokens" in \
        capsys.readouterr().err


def test_plot_titles_count_the_requests_kept(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the slice before the too-long were dropped."""
    trace = write_trace(tmp_path / "t.jsonl", (30, 4), (90, 10), (60, 4))
    titles: list[str] = []
    monkeypatch.setattr(replay_main, "replay_all", lambda args, base, fitted: [
        make_run(policy, {0: [1], 1: [2]}) for policy in ("recompute", "offload")])
    monkeypatch.setattr(replay_main.plots, "latency_cdfs",
                        lambda runs, slo, path, title: titles.append(title))
    assert replay(tmp_path, trace, "--num-blocks", "4") == 0
    assert titles == ["tiny, 2 requests, lengths x1, 1 req/s"]


@pytest.mark.parametrize("where", ["--out", "--write-trace"])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_stack_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], where: str) -> None:
    """Not a traceback once the runs are done (--out: their results lost) or
    once the first stack is up (--write-trace)."""
    trace = write_trace(tmp_path / "t.jsonl", (30, 4), (60, 4))
    (tmp_path / "a-file").write_text("")
    started: list[int] = []
    monkeypatch.setattr(replay_main, "replay_all", lambda args, base, fitted: started.append(1))
    bad = str(tmp_path / "a-file" / "under-it")
    flags = ["--out", bad] if where == "--out" else ["--write-trace", f"{bad}.jsonl"]
    assert replay_main.main(["--trace", str(trace), "--block-tokens", "16", *flags]) == 2
    assert "a-file/under-it" in capsys.readouterr().err
    assert started == []


def test_an_out_directory_no_file_can_be_made_in_is_refused_before_any_stack_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--out /proc (or a read-only directory): it exists, so it was taken,
    and the runs' results went nowhere after them, in a traceback."""
    trace = write_trace(tmp_path / "t.jsonl", (30, 4), (60, 4))
    started: list[int] = []
    monkeypatch.setattr(replay_main, "replay_all", lambda args, base, fitted: started.append(1))
    assert replay_main.main(["--trace", str(trace), "--block-tokens", "16", "--out",
                             "/proc"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert started == []


def test_default_max_context_drops_what_a_checkpoint_cannot_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint directory's worker serves its max_position_embeddings
    (64 here), fewer than the pool holds (8 blocks of 16): a longer request
    would be refused at admission, so the slice drops it."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}))
    trace = write_trace(tmp_path / "t.jsonl", (30, 4), (90, 10), (60, 4))
    seen: list[tuple[int | None, int]] = []

    def replay_all(args: argparse.Namespace, base: StackConfig,
                   fitted: list[tuple[Trace, int]]) -> list[RunResult]:
        seen.append((args.max_context, fitted[0][1]))
        return [make_run(policy, {0: [1], 1: [2]}) for policy in ("recompute", "offload")]

    monkeypatch.setattr(replay_main, "replay_all", replay_all)
    assert replay(tmp_path, trace, "--num-blocks", "8", "--model", str(checkpoint)) == 0
    assert seen == [(64, 1)]


@pytest.mark.parametrize(("value", "expected"), [("-1", None), ("nan", None), ("0", "none"),
                                                 ("2.5", 2.5)])
def test_request_timeout_is_checked_and_zero_means_none(
        tmp_path: Path, value: str, expected: float | str | None) -> None:
    trace = write_trace(tmp_path / "t.jsonl", (30, 4))
    argv = ["--trace", str(trace), "--request-timeout", value]
    if expected is None:
        with pytest.raises(SystemExit) as exit_info:
            replay_main.parse_args(argv)
        assert exit_info.value.code == 2
    else:
        args = replay_main.parse_args(argv)
        assert args.request_timeout == (None if expected == "none" else expected)
