"""bench.replay.aiperf_check's flags, and its reading of aiperf's results with a fake aiperf."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.replay import aiperf_check
from kvstash.launch.stack import StackConfig
from kvstash.workload.trace import Trace, TraceRequest


@contextlib.contextmanager
def fake_stack(config: StackConfig) -> Iterator[SimpleNamespace]:
    yield SimpleNamespace(gateway=SimpleNamespace(url="http://127.0.0.1:1"))


def test_a_failed_aiperf_round_is_not_read_from_the_last_rounds_results(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aiperf_check, "running_stack", fake_stack)
    stale = tmp_path / "aiperf" / "profile_export_aiperf.json"
    stale.parent.mkdir()
    names = ("time_to_first_token", "inter_token_latency", "inter_chunk_latency",
             "request_latency", "request_throughput", "output_token_throughput")
    stale.write_text(json.dumps({name: {"p50": 1.0, "avg": 1.0} for name in names}))
    failing = tmp_path / "aiperf.sh"
    failing.write_text("#!/bin/sh\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(subprocess.CalledProcessError):
        aiperf_check.theirs(StackConfig(gateway=True), str(failing), tmp_path,
                            tmp_path / "slice.jsonl", 32)


@pytest.mark.parametrize("rounds", ["0", "-1"])
def test_aiperf_check_refuses_zero_rounds(capsys: pytest.CaptureFixture[str],
                                          rounds: str) -> None:
    """Before any stack starts, not an IndexError after the set-up."""
    with pytest.raises(SystemExit) as done:
        aiperf_check.main(["--aiperf", "/nonexistent", "--rounds", rounds])
    assert done.value.code == 2
    assert f"--rounds must be >= 1, got {rounds}" in capsys.readouterr().err


def test_a_replayer_round_with_failed_requests_is_not_compared() -> None:
    """Its p50s would be of the requests that completed only: here the one
    longer than the tiny model serves is refused, through smg."""
    trace = Trace((TraceRequest(0.0, 16, 4, (0,)), TraceRequest(0.1, 1100, 4, tuple(range(1, 70))),
                   TraceRequest(0.2, 16, 4, (0,))), 16)
    with pytest.raises(RuntimeError, match=r"1 of 3 requests failed \(request 1 HTTP_400"):
        aiperf_check.ours(StackConfig(gateway=True), trace)


def test_a_max_context_past_the_tiny_model_is_refused_before_any_stack_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 1500,
                                         "output_length": 4, "hash_ids": [0, 1, 2]}) + "\n"
                             for t in (0, 500)), encoding="utf-8")
    assert aiperf_check.main(["--aiperf", "/nonexistent", "--trace", str(trace),
                              "--length-scale", "1", "--max-context", "2048"]) == 2
    assert "--max-context 2048 is more than an instance serves: 1024" in \
        capsys.readouterr().err


def test_requests_sent_at_once_are_spaced_in_the_traces_order() -> None:
    """Each tool sent a burst in its own order, and the order sets the
    burst's TTFTs: both now send it in the trace's, 10 ms apart."""
    trace = Trace(tuple(TraceRequest(t, 16 * (i + 1), 1, (i,))
                        for i, t in enumerate((0.0, 0.0, 0.0, 1.0, 2.0, 2.0))), 16)
    out = aiperf_check.spaced(trace)
    assert [r.arrival_s for r in out.requests] == pytest.approx([0.0, 0.01, 0.02, 1.0, 2.0, 2.01])
    assert [r.input_length for r in out.requests] == [r.input_length for r in trace.requests]
