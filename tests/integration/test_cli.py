"""The `kvstash` command as users run it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

from kvstash.client import Client


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone once reaped or marked Z.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_up_serves_then_ctrl_c_leaves_no_process_behind() -> None:
    up = subprocess.Popen(
        [sys.executable, "-m", "kvstash.cli", "up", "--listen", "127.0.0.1:0",
         "--num-blocks", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert up.stdout is not None
    services: dict[str, tuple[str, int]] = {}
    deadline = time.monotonic() + 120
    while len(services) < 3 and time.monotonic() < deadline:
        line = up.stdout.readline()
        if match := re.match(r"(\w+)\s+(\S+:\d+)\s+pid (\d+)", line):
            services[match[1]] = (match[2], int(match[3]))
    assert set(services) == {"cache", "worker", "scheduler"}, services

    async def call() -> list[int]:
        async with Client(services["scheduler"][0]) as client:
            return (await client.complete([1, 2, 3], max_tokens=4, ignore_eos=True)).token_ids

    assert len(asyncio.run(call())) == 4
    pids = [pid for _, pid in services.values()]
    assert all(_alive(pid) for pid in pids)

    up.send_signal(signal.SIGINT)  # what Ctrl-C sends
    assert up.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)]


def test_every_service_runs_alone_with_help() -> None:
    for module in ("scheduler_svc", "cache_svc", "gpu_worker", "kvstash.cli"):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "--listen" in out.stdout or module == "kvstash.cli"
