"""`python -m gpu_worker` as launchers run it, and WorkerConfig validation."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker.config import WorkerConfig
from kvstash.rpc import insecure_channel
from kvstash.v1 import worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "/no/such/dir"}, "'/no/such/dir' is not"),
        ({"dtype": "int8"}, "dtype must be one of .* got 'int8'"),
        ({"device": "tpu"}, "got 'tpu'"),
        ({"block_size": 0}, r"block_size must be in \[1, 1024\], got 0"),
        ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
        ({"cache_address": "localhost"}, "host:port, got 'localhost'"),
        ({"cache_timeout_s": 0}, "cache_timeout_s must be > 0, got 0"),
    ],
)
def test_config_names_the_bad_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**kwargs)  # type: ignore[arg-type]


def test_help_works() -> None:
    out = subprocess.run([sys.executable, "-m", "gpu_worker", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True)
    assert "--num-blocks" in out.stdout and "--cache-address" in out.stdout


def test_bad_flag_value_exits_with_message() -> None:
    out = subprocess.run([sys.executable, "-m", "gpu_worker", "--num-blocks", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "num_blocks must be >= 1, got 0" in out.stderr


async def test_serves_announces_and_stops_on_sigterm() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpu_worker", "--listen", "127.0.0.1:0", "--num-blocks", "16",
        "--log-level", "warning",
        cwd=REPO, stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().split()
        assert line[:2] == ["KVSTASH_READY", "worker"], line
        async with insecure_channel(line[2]) as channel:
            info = await worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        assert info.num_blocks == 16
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
