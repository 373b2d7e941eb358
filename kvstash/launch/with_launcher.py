"""`python -m kvstash.launch.with_launcher PID PROGRAM [ARG...]`: PROGRAM,
run in this same process (exec), sent SIGTERM when its parent, the launcher
of pid PID, dies: even of a SIGKILL (the OOM killer, `kill -9`, a CI
runner's timeout), which no handler of the launcher's can catch. Linux's
parent-death signal (prctl PR_SET_PDEATHSIG), which an exec keeps.

A process of its own rather than Popen's preexec_fn: a preexec_fn makes the
fork run Python's at-fork handlers, and gRPC's crashed a launcher's child
there (SIGSEGV) once the launcher had channels open.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def main(argv: list[str]) -> None:
    launcher, program = int(argv[0]), argv[1:]
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher:  # it died before prctl: no signal will come
        sys.exit(1)
    os.execvp(program[0], program)


if __name__ == "__main__":
    main(sys.argv[1:])
