"""A stack's data directory (the cache's disk tier, up to its disk budget):
locked while its launcher lives, and removed by the next launcher when a
killed one (SIGKILL, the OOM killer) left it behind.

The services die with their launcher (launch/with_launcher.py), and a
cache's arena is removed by the next cache (cache_svc/arena.py); the data
directory has no process of its own to do that, so each launcher, before
it makes its own, removes every directory of this user's marked as a
launcher's and no longer locked. The kernel drops a lock when its process
ends, however it ends: a live launcher's directory is never taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "kvstash-"
# Made once the directory is locked: a directory without it is not ours
# (kvstash-logs-*, another program's) or not yet locked, and is left alone.
MARK = ".kvstash-data-dir"


class DataDir(tempfile.TemporaryDirectory[str]):
    """A temporary directory this process holds a lock on while it lives."""

    def __init__(self) -> None:
        remove_stale(Path(tempfile.gettempdir()))
        super().__init__(prefix=PREFIX)
        self._fd: int | None = os.open(self.name, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        Path(self.name, MARK).touch()

    def cleanup(self) -> None:
        super().cleanup()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def remove_stale(directory: Path) -> int:
    """Removes this user's marked data directories under `directory` that
    no live launcher locks; returns how many."""
    removed = 0
    for path in directory.glob(f"{PREFIX}*"):
        try:
            status = path.lstat()
            if (not stat.S_ISDIR(status.st_mode) or status.st_uid != os.geteuid()
                    or not (path / MARK).exists()):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its launcher lives
            shutil.rmtree(path, ignore_errors=True)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        if not path.exists():
            log.info("removed %s, left by a launcher that was killed", path)
            removed += 1
    return removed
