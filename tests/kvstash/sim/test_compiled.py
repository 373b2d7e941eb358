"""`kvstash sim --core compiled`: the scheduler core compiled by mypyc decides
exactly as its sources do, and a build is used only for the sources it was
built from."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstash.sim import compiled
from tests.gpu_worker.worker_factories import REPO

# Tight enough that every policy preempts (and AUTO chooses), small enough for seconds.
PRESSED = ["--synthetic", "120", "--rates", "8", "--synthetic-input", "300",
           "--synthetic-output", "120", "--num-blocks", "96", "--max-num-seqs", "24",
           "--policies", "recompute,offload,auto,offload-fixed"]


def sim(core: str, out: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "kvstash.sim", "sim", "--core", core, *PRESSED,
                           *extra, "--json", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


def same_runs(fast: dict[str, Any], slow: dict[str, Any]) -> None:
    assert (fast["setup"]["core"], slow["setup"]["core"]) == ("compiled", "python")
    for a, b in zip(fast["runs"], slow["runs"], strict=True):
        a.pop("sim_seconds"), b.pop("sim_seconds")
        assert a == b  # every figure and counter, to the last bit


def test_the_compiled_core_decides_as_its_sources(tmp_path: Path, compiled_core: str) -> None:
    out, fast = sim("compiled", tmp_path / "compiled.json")
    assert "core: compiled" in out
    _, slow = sim("python", tmp_path / "python.json")
    same_runs(fast, slow)
    counters = {run["policy"]: run["counters"] for run in slow["runs"]}
    assert counters["recompute"]["num_preemptions_recompute"] > 0
    assert counters["offload"]["num_preemptions_offload"] > 0
    # P/D pools: reservations, hand-offs through the cache, take-backs.
    pools = ("--prefill-instances", "1", "--decode-instances", "2")
    fast = sim("compiled", tmp_path / "pd-compiled.json", *pools)[1]
    slow = sim("python", tmp_path / "pd-python.json", *pools)[1]
    same_runs(fast, slow)
    assert all(run["counters"]["num_handoffs"] > 0 for run in slow["runs"])
    # Built once, `auto` finds it.
    assert sim("auto", tmp_path / "auto.json")[1]["setup"]["core"] == "compiled"


def test_auto_runs_the_sources_where_nothing_was_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTASH_CACHE_DIR", str(tmp_path / "empty"))
    out, result = sim("auto", tmp_path / "auto.json")
    assert result["setup"]["core"] == "python"
    assert "--core compiled" in out  # the hint
    assert not (tmp_path / "empty").exists()  # auto never builds


def test_a_build_belongs_to_the_sources_it_was_built_from(tmp_path: Path) -> None:
    core = tmp_path / "scheduler_svc" / "core"
    shutil.copytree(REPO / "scheduler_svc" / "core", core)
    files = compiled.sources(tmp_path)
    assert [p.name for p in files] == sorted(p.name for p in core.glob("*.py")
                                             if p.name != "__init__.py")
    before = compiled.key(files)
    assert compiled.key(files) == before
    (core / "costs.py").write_text((core / "costs.py").read_text() + "\n")
    assert compiled.key(files) != before
    assert compiled.built(tmp_path / "nothing", files) is None


def test_a_bad_core_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvstash.sim", "sim", "--core", "pypy"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "--core must be one of auto, compiled, python" in done.stderr


def test_a_cache_that_cannot_be_made_is_one_line(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A build directory that cannot be made (a read-only home, a file in the
    way) was a traceback."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("KVSTASH_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    done = subprocess.run([sys.executable, "-m", "kvstash.sim", "sim", "--core", "compiled",
                           *PRESSED], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2
    assert done.stderr == (f"kvstash sim: --core compiled: cannot build into "
                           f"{tmp_path / 'a-file' / 'cache'} (Not a directory; "
                           f"KVSTASH_CACHE_DIR names another)\n")
