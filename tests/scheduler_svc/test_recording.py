"""--record-decisions (scheduler_svc.recording): the record it writes. That
a record replays to the same decisions is tests/kvstash/sim/test_decisions_replay.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from scheduler_svc.recording import RecordingScheduler
from tests.scheduler_svc.factories import add, make_config, run_to_end


def test_the_record_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """It holds every prompt and every output."""
    path = tmp_path / "decisions.jsonl"
    old_umask = os.umask(0o022)
    try:
        RecordingScheduler(make_config(), path).close()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_full_disk_ends_the_record_not_the_scheduler(tmp_path: Path) -> None:
    """The write's OSError came out of schedule(), update(), add_request()
    (after the core had taken the request): the engine's step loop failed
    on it and the scheduler exited, ending every request."""
    path = tmp_path / "decisions.jsonl"
    core = RecordingScheduler(make_config(), path)
    add(core, "before")
    written = path.read_text()
    full = os.open("/dev/full", os.O_WRONLY)  # every write fails: ENOSPC
    try:
        os.dup2(full, core._file.fileno())
    finally:
        os.close(full)
    add(core, "after", max_tokens=3)
    run_to_end(core)  # schedule() and update() as the engine calls them
    assert not core.has_unfinished_requests
    core.close()
    assert path.read_text() == written  # the record ends at the last call written
    assert [json.loads(line)["op"] for line in written.splitlines()] == ["config", "add"]
