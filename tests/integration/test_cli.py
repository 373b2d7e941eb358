"""The `kvstash` command as users run it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvstash.client import Client
from kvstash.stack import StackConfig, running_stack


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
                             text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        assert "--listen" in out.stdout or module == "kvstash.cli"


def test_scheduler_exports_prometheus_metrics(tmp_path: Path) -> None:
    with socket.socket() as s:  # a free port for the metrics endpoint
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    config = StackConfig(num_blocks=32, scheduler_args=("--metrics-port", str(metrics_port)))
    with running_stack(config, tmp_path) as stack:

        async def call() -> None:
            async with Client(stack.address) as client:
                await client.complete([1, 2, 3], max_tokens=4, ignore_eos=True)

        asyncio.run(call())
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    assert "kvstash_scheduler_num_total_blocks 32.0" in text
    assert "kvstash_scheduler_finished_requests_total 1.0" in text
    assert "kvstash_scheduler_ttft_seconds_count 1.0" in text
    assert "kvstash_scheduler_time_per_output_token_seconds_count 1.0" in text
    assert "kvstash_scheduler_new_token_ratio" in text
