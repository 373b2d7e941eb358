"""A stop signal that lands as a service's process is being created (inside
Popen, or before start_service holds the child) must still stop that child:
`kvstash up` stopped while starting leaves nothing behind. Run in a process
of its own, whose SIGTERM handler raises as `kvstash up`'s does."""

from __future__ import annotations

import subprocess
import sys

from tests.gpu_worker.worker_factories import REPO

SCRIPT = """
import os, signal, sys, tempfile, time
from pathlib import Path
from kvstash.launch import processes

class Stop(Exception):
    pass

def stop(signum, frame):
    raise Stop()

signal.signal(signal.SIGTERM, stop)
real = processes.subprocess.Popen

def popen(*args, **kwargs):
    child = real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # the stop lands as the child exists
    return child

processes.subprocess.Popen = popen
try:
    processes.start_service("cache", "cache_svc", ["--listen", "127.0.0.1:0"],
                            Path(tempfile.mkdtemp()))
except Stop:
    print("stopped")

def children():
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(stat.parent.name)
    return found

print("children", len(children()))
"""


def test_a_stop_as_a_service_is_created_stops_it() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["stopped", "children", "0"], done.stdout
