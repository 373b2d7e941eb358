"""Decisions exact: a real stack under KV pressure records every call into
its scheduler core (--record-decisions); replayed into a fresh core by
`kvstash sim --replay`, every decision comes out the same. So do both
instances of a P/D pair."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.replay.__main__ import main as replay_main
from kvstash.client import Client
from kvstash.common.sampling import SamplingParams
from kvstash.launch.stack import StackConfig, running_stack
from kvstash.sim.__main__ import main
from kvstash.sim.profile import DEFAULT_PROFILE, read_profile
from kvstash.sim.replay import read_record, replay
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.recording import RecordingScheduler
from tests.bench.test_replay_e2e import PRESSURE
from tests.gpu_worker.worker_factories import REPO


def test_a_recorded_run_replays_to_the_same_decisions(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], compiled_core: str) -> None:
    record = tmp_path / "decisions.jsonl"
    args = [a if a != "--init-new-token-ratio 0.1" else
            f"--init-new-token-ratio 0.1 --record-decisions {record}" for a in PRESSURE]
    assert replay_main([*args, "--policies", "auto", "--out", str(tmp_path / "out")]) == 0
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    ops = {line["op"] for line in lines}
    assert {"config", "add", "schedule", "step", "update", "offloaded", "restored"} <= ops
    capsys.readouterr()
    assert main(["sim", "--replay", str(record)]) == 0
    out = capsys.readouterr().out
    assert "every decision identical to the record" in out
    # The replay went through the preemptions and copies, not around them.
    preemptions = sum(len(line["decided"]["preempted"]) for line in lines
                      if line["op"] == "schedule")
    assert preemptions > 0 and f"{preemptions} preemptions" in out
    steps = sum(1 for line in lines if line["op"] == "step")
    assert f"prediction, over {steps} steps: p50" in out  # the profile set beside each step
    # The core compiled by mypyc (`kvstash sim --core compiled`) decides as the
    # sources that served the run did.
    done = subprocess.run([sys.executable, "-m", "kvstash.sim", "sim", "--core", "compiled",
                           "--replay", str(record)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "every decision identical to the record" in done.stdout
    # A profile whose step line is fitted to this served run's steps times them.
    fitted = tmp_path / "served.json"
    assert main(["calibrate", str(fitted), "--from-record", str(record)]) == 0
    profile = read_profile(fitted)
    assert "--from-record decisions.jsonl" in profile.source["step"]
    assert profile.copy == read_profile(DEFAULT_PROFILE).copy
    done = replay(read_record(record), profile)
    assert len(done.step_ratios) == steps and 0.67 < statistics.median(done.step_ratios) < 1.5
    # It is fitted to each step's turn of the engine's loop: the step and
    # the scheduler's own time around it, from one schedule() to the next.
    assert steps - 1 <= len(done.turns) <= steps
    assert all(turn > seconds
               for (_, seconds), turn in zip(done.steps, done.turns, strict=False))
    assert "the loop's own time a step" in out


def test_a_tampered_record_is_caught(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The check can fail: one changed sampled token changes what follows."""
    record = tmp_path / "decisions.jsonl"
    args = [a if a != "--init-new-token-ratio 0.1" else
            f"--init-new-token-ratio 0.1 --record-decisions {record}" for a in PRESSURE]
    assert replay_main([*args, "--policies", "recompute", "--out", str(tmp_path / "o")]) == 0
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    # One fewer step's seconds would not show; a request added late does:
    adds = [i for i, line in enumerate(lines) if line["op"] == "add"]
    moved = lines.pop(adds[1])
    lines.insert(len(lines) - 1, moved)
    record.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["sim", "--replay", str(record)]) == 1
    assert "DECISIONS DIFFER" in capsys.readouterr().err
    # Nor is a profile fitted to its steps (they are not the steps it ran).
    assert main(["calibrate", str(tmp_path / "p.json"), "--from-record", str(record)]) == 2
    assert "does not replay" in capsys.readouterr().err
    assert main(["calibrate", str(tmp_path / "p.json"), "--from-record",
                 str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_a_recorded_pd_pair_replays_to_the_same_decisions(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both instances of a real P/D stack record; each record, the edge's
    reservations, remote decodes, hand-offs and remote finishes included,
    replays into a fresh core identically."""
    prefill, decode = tmp_path / "prefill.jsonl", tmp_path / "decode.jsonl"
    config = StackConfig(pd=True, num_blocks=64,
                         prefill_scheduler_args=("--record-decisions", str(prefill)),
                         decode_scheduler_args=("--record-decisions", str(decode)))
    prompts = [[(i * 13 + j * 7 + 1) % 256 for j in range(10 + 9 * i)] for i in range(6)]

    async def complete_all(address: str) -> None:
        async with Client(address) as client:
            await asyncio.gather(*[client.complete(p, max_tokens=12, ignore_eos=True)
                                   for p in prompts])

    with running_stack(config, tmp_path) as stack:
        asyncio.run(complete_all(stack.address))
    ops = {path: [json.loads(line)["op"] for line in path.read_text().splitlines()]
           for path in (prefill, decode)}
    assert ops[prefill].count("handed_off") == ops[prefill].count("remote_finish") == 6
    assert ops[decode].count("remote") == 6 and "reserve" in ops[decode]
    for path in (prefill, decode):
        capsys.readouterr()
        assert main(["sim", "--replay", str(path)]) == 0, capsys.readouterr().err
        assert "every decision identical to the record" in capsys.readouterr().out
    # The check can fail here too: a refusal where the record says accepted.
    lines = [json.loads(line) for line in decode.read_text().splitlines()]
    first = next(line for line in lines if line["op"] == "reserve" and line["accepted"])
    first["accepted"] = False
    decode.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["sim", "--replay", str(decode)]) == 1
    assert "reserve" in capsys.readouterr().err


@pytest.mark.parametrize("text, error", [
    ("[1, 2]\n", "its first line is no config"),
    ('{"op": "config"}\n', ":1: not a scheduler config"),
    ('{"op": "config", "config": {}}\n', ":1: not a scheduler config"),
    ('{"op": "config", "config": {"eos_token_ids": [1]}}\n[3]\n', ":2: not a decision"),
])
def test_a_record_that_is_none_is_refused_naming_its_line(
        tmp_path: Path, text: str, error: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Not tracebacks (found in review, 2026-11-28)."""
    record = tmp_path / "bad.jsonl"
    record.write_text(text)
    assert main(["sim", "--replay", str(record)]) == 2
    assert error in capsys.readouterr().err


def _recorded(path: Path) -> list[dict[str, object]]:
    """A real core's record of one request served to its end, three steps."""
    core = RecordingScheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64,
                                              vocab_size=100), path)
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    for token in (8, 9, 10):
        out = core.schedule()
        core.observe_step(out, 0.01)
        core.update(out, {"a": token})
    core.close()
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("op, field, value", [
    ("step", "seconds", "x"),  # TypeError: a str over the profile's float
    ("add", "sampling", [1]),  # TypeError: not a mapping
    ("update", "sampled", None),  # TypeError: None is not iterable
    ("add", "op", [1]),  # TypeError: unhashable
    ("schedule", "op", "step"),  # a step before any schedule(): an AssertionError
])
def test_a_record_with_a_call_of_the_wrong_shape_differs_naming_its_line(
        tmp_path: Path, op: str, field: str, value: object,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A tampered field in a well-formed record: each was a traceback; now
    the line it is on, and what the core made of it."""
    record = tmp_path / "decisions.jsonl"
    lines = _recorded(record)
    assert main(["sim", "--replay", str(record)]) == 0
    n = next(i for i, line in enumerate(lines) if line["op"] == op)
    lines[n][field] = value
    record.write_text("".join(json.dumps(line) + "\n" for line in lines))
    capsys.readouterr()
    assert main(["sim", "--replay", str(record)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"DECISIONS DIFFER at line {n + 1}: ") and \
        "the replayed core refused it" in err, err
