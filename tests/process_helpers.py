"""Processes a test started, and what they started, read from /proc."""

from __future__ import annotations

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
