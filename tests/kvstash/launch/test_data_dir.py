"""The launcher's data directory: locked while its launcher lives, removed
by the next launcher once a killed one left it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvstash.launch.data_dir import MARK, PREFIX, DataDir, remove_stale

REPO = Path(__file__).resolve().parents[3]


def launcher_holding_a_data_dir(tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    """A real process that made a DataDir under `tmp` and lives on."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; from kvstash.launch.data_dir import DataDir; "
         "d = DataDir(); print(d.name, flush=True); time.sleep(600)"],
        cwd=REPO, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, Path(process.stdout.readline().strip())


def test_a_killed_launchers_data_dir_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    live, live_dir = launcher_holding_a_data_dir(tmp_path)
    killed, killed_dir = launcher_holding_a_data_dir(tmp_path)
    try:
        (killed_dir / "cache").mkdir()
        (killed_dir / "cache" / "snapshot.kv").write_bytes(b"x" * 4096)
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert killed_dir.is_dir() and (live_dir / MARK).exists()
        assert remove_stale(tmp_path) == 1
        assert not killed_dir.exists()
        assert live_dir.is_dir()
    finally:
        live.kill()
        live.wait(30)
    assert remove_stale(tmp_path) == 1  # now the other one, its launcher gone too
    assert not live_dir.exists()


def test_directories_not_marked_as_a_launchers_are_left_alone(tmp_path: Path) -> None:
    """Logs (kept on purpose), another program's kvstash-* directory, a file."""
    logs = tmp_path / f"{PREFIX}logs-abc"
    other = tmp_path / f"{PREFIX}something"
    for path in (logs, other):
        path.mkdir()
        (path / "kept").write_text("")
    (tmp_path / f"{PREFIX}file").write_text("")
    assert remove_stale(tmp_path) == 0
    assert (logs / "kept").exists() and (other / "kept").exists()


def test_a_data_dir_is_gone_after_cleanup(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = DataDir()
    name = Path(made.name)
    assert (name / MARK).exists()
    assert remove_stale(tmp_path) == 0  # this process holds it
    made.cleanup()
    assert not name.exists()
