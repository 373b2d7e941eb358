"""Processes a test started, and what they started, read from /proc."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path


def child_pids(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def descendant_pids(pid: int) -> list[int]:
    found = child_pids(pid)
    return found + [d for child in found for d in descendant_pids(child)]


def is_running(pid: int) -> bool:
    """Neither gone nor a zombie (an orphan's exit may never be reaped here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def as_at_a_terminal(argv: list[str]) -> list[str]:
    """`argv` (a program and its arguments) run with SIGINT's default
    disposition: a test run started in the background by a shell (`make test
    &`, a CI runner's script) has SIGINT ignored, its children too, and a
    program that starts with it ignored never sees a Ctrl-C."""
    return [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
            "signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])", *argv]


def interrupt_once(argv: list[str], cwd: Path, when: str) -> tuple[int, str]:
    """Runs `argv` (as at a terminal), sends it SIGINT (Ctrl-C) as soon as a
    line of its stderr holds `when`, and returns its exit status and whole
    stderr."""
    process = subprocess.Popen(as_at_a_terminal(argv), cwd=cwd, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    seen = []
    for line in process.stderr:
        seen.append(line)
        if when in line:
            process.send_signal(signal.SIGINT)
            break
    try:
        rest = process.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        process.kill()
        rest = process.communicate()[1] + "\n(still running 60 s after SIGINT: killed)"
    return process.returncode, "".join(seen) + rest
