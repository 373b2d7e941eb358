"""--record-decisions (scheduler_svc.recording): the record it writes. That
a record replays to the same decisions is tests/kvstash/sim/test_decisions_replay.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from scheduler_svc.recording import RecordingScheduler
from tests.scheduler_svc.factories import make_config


def test_the_record_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """It holds every prompt and every output."""
    path = tmp_path / "decisions.jsonl"
    old_umask = os.umask(0o022)
    try:
        RecordingScheduler(make_config(), path).close()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
