"""`python -m gpu_worker` as launchers run it, and WorkerConfig validation."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_worker.__main__ import parse_args
from gpu_worker.config import WorkerConfig
from kvstash.common.cpu import usable_cpus
from kvstash.common.rpc_connections import insecure_channel
from kvstash.v1 import worker_pb2, worker_pb2_grpc
from tests.gpu_worker.test_worker_checkpoint import LLAMA, write_checkpoint
from tests.gpu_worker.worker_factories import REPO, worker_process
from tests.process_helpers import as_at_a_terminal, interrupt_once


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "/no/such/dir"}, "'/no/such/dir' is not"),
        ({"dtype": "int8"}, "dtype must be one of .* got 'int8'"),
        ({"device": "tpu"}, "got 'tpu'"),
        # Once taken, then a NotImplementedError traceback at load where torch has no MPS.
        ({"device": "mps"}, "device must be auto, cpu, cuda or cuda:N, got 'mps'"),
        ({"block_size": 0}, r"block_size must be in \[1, 1024\], got 0"),
        ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
        ({"cache_address": "localhost"}, r"host:port \(port 0-65535\), got 'localhost'"),
        # gRPC would take the port modulo 65536 and offload to whatever listens on 34463.
        ({"cache_address": "127.0.0.1:99999"}, r"\(port 0-65535\), got '127.0.0.1:99999'"),
        ({"cache_timeout_s": 0}, "cache_timeout_s must be finite and > 0, got 0"),
        # Neither bounds an offload or restore: it would hang for good.
        ({"cache_timeout_s": float("nan")}, "cache_timeout_s must be finite and > 0, got nan"),
        ({"cache_timeout_s": float("inf")}, "cache_timeout_s must be finite and > 0, got inf"),
        ({"max_model_len": 2**24 + 1}, r"max_model_len must be in \[1, 16777216\], got 16777217"),
        ({"metrics_port": 70000}, r"metrics_port must be in \[0, 65535\], got 70000"),
        ({"metrics_host": ""}, "metrics_host '' is not an IP address or host name"),
        ({"row_tile": 0}, r"row_tile must be in \[1, 4096\], got 0"),
        ({"cuda_graph_rows": -1}, r"cuda_graph_rows must be in \[0, 8192\], got -1"),
        ({"cuda_graph_rows": 8193}, r"cuda_graph_rows must be in \[0, 8192\], got 8193"),
        ({"host_pool_bytes": -1}, "host_pool_bytes must be >= 0, got -1"),
        ({"num_threads": -1}, r"num_threads must be >= 0 \(0 = the usable CPUs\), got -1"),
    ],
)
def test_config_names_the_bad_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**kwargs)  # type: ignore[arg-type]


def test_step_and_buffer_flags_reach_the_config() -> None:
    _, config = parse_args([])
    assert config == WorkerConfig()  # every default comes from the dataclass
    assert config.batch_invariant and config.row_tile is None
    _, config = parse_args(["--no-batch-invariant", "--row-tile", "32", "--host-pool", "1GiB",
                            "--cuda-graph-rows", "0"])
    assert (config.batch_invariant, config.row_tile, config.host_pool_bytes,
            config.cuda_graph_rows) == (False, 32, 1 << 30, 0)


def test_num_threads_reaches_torch() -> None:
    import torch

    from gpu_worker.runner import build_runner

    _, config = parse_args(["--num-threads", "1", "--num-blocks", "8"])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        build_runner(config)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_default_threads_are_the_usable_cpus(caplog: pytest.LogCaptureFixture) -> None:
    """num_threads 0: as many as this process may use, not torch's default
    (the process's start-up count, whatever the cgroup allows); logged with why."""
    import torch

    from gpu_worker.runner import build_runner

    usable = usable_cpus()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(usable.num_cpus + 1)
        with caplog.at_level(logging.INFO, logger="gpu_worker.runner"):
            build_runner(WorkerConfig(num_blocks=8))
        assert torch.get_num_threads() == usable.num_cpus
        assert torch.get_num_interop_threads() == 1
        assert f"{usable.num_cpus} torch threads: {usable.reason}" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gpu_worker.runner"):
            build_runner(parse_args(["--num-threads", "3", "--num-blocks", "8"])[1])
        assert torch.get_num_threads() == 3
        assert "3 torch threads: --num-threads" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_help_works() -> None:
    out = subprocess.run([sys.executable, "-m", "gpu_worker", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True)
    assert "--num-blocks" in out.stdout and "--cache-address" in out.stdout
    assert "--metrics-port" in out.stdout and "--metrics-host" in out.stdout


def test_flags_and_environment_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    _, config = parse_args([])
    assert (config.dtype, config.metrics_port, config.metrics_host) == ("auto", 0, "127.0.0.1")
    monkeypatch.setenv("KVSTASH_WORKER_METRICS_PORT", "9500")
    assert parse_args([])[1].metrics_port == 9500
    _, config = parse_args(["--metrics-port", "9400", "--metrics-host", "0.0.0.0",
                            "--dtype", "bfloat16"])
    assert (config.dtype, config.metrics_port, config.metrics_host) == (
        "bfloat16", 9400, "0.0.0.0")


def test_bad_flag_value_exits_with_message() -> None:
    out = subprocess.run([sys.executable, "-m", "gpu_worker", "--num-blocks", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "num_blocks must be >= 1, got 0" in out.stderr


def test_a_max_model_len_past_the_models_exits_with_message() -> None:
    """Not served quietly at the model's 1024 while the user asked for 4096."""
    out = subprocess.run([sys.executable, "-m", "gpu_worker", "--listen", "127.0.0.1:0",
                          "--num-blocks", "8", "--max-model-len", "4096"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2, out.stderr
    assert "max_model_len 4096 is more than the model's own 1024" in out.stderr
    assert "KVSTASH_READY" not in out.stdout


def _truncated(shard: Path) -> None:
    shard.write_bytes(shard.read_bytes()[:-100])


def _dangling(shard: Path) -> None:
    """A Hub snapshot copied without -L: each file a symlink into a blobs/ that is not there."""
    shard.unlink()
    shard.symlink_to(Path("../../blobs/0123abcd"))


@pytest.mark.parametrize("spoil", [_truncated, _dangling], ids=["corrupt", "broken-symlink"])
def test_cli_reports_an_unreadable_shard_without_a_traceback(
        tmp_path: Path, spoil: Callable[[Path], None]) -> None:
    write_checkpoint(tmp_path, LLAMA, shards=1)
    shard = next(tmp_path.glob("*.safetensors"))
    spoil(shard)
    out = subprocess.run(
        [sys.executable, "-m", "gpu_worker", "--listen", "127.0.0.1:0", "--model", str(tmp_path),
         "--device", "cpu", "--num-blocks", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=90, check=False)
    assert out.returncode == 2, out.stderr[-800:]
    assert f"{shard.name} is not a readable safetensors file" in out.stderr
    assert "Traceback" not in out.stderr


async def test_serves_announces_and_stops_on_sigterm() -> None:
    async with worker_process("--num-blocks", "16") as worker:
        async with insecure_channel(worker.address) as channel:
            info = await worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        assert info.num_blocks == 16
        worker.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(worker.process.wait(), 30) == 0


# `python -m gpu_worker` whose model load takes ten minutes, as a large
# checkpoint's can: the tiny model loads in about 2 s, which a SIGINT sent on
# the "loading" line could miss on a loaded machine, and a plain exit's wait
# for it would go unseen.
_SLOW_LOAD = """
import signal, sys, threading, time
import gpu_worker.runner

def load_for_minutes(config):
    print("test: load started", file=sys.stderr, flush=True)
    if "--self-interrupt" in sys.argv:  # a Ctrl-C the kernel delivers to this thread
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
    time.sleep(600)
    raise SystemExit("test: the load was never interrupted")

gpu_worker.runner.load_model = load_for_minutes
from gpu_worker.__main__ import main
sys.exit(main([a for a in sys.argv[1:] if a != "--self-interrupt"]))
"""
_WORKER_ARGS = ["--listen", "127.0.0.1:0", "--device", "cpu", "--num-blocks", "16"]


def test_ctrl_c_while_the_model_loads_is_one_line_and_status_130() -> None:
    """SIGINT while the worker loads its model ends it at once, with one line
    and 130: a plain exit would wait for the load on the compute thread
    (here ten minutes; interrupt_once kills it after one)."""
    status, stderr = interrupt_once([sys.executable, "-c", _SLOW_LOAD, *_WORKER_ARGS], REPO,
                                    when="test: load started")
    assert "Traceback" not in stderr, stderr
    assert stderr.rstrip().splitlines()[-1] == "gpu_worker: interrupted while starting", stderr
    assert status == 130


def test_ctrl_c_delivered_to_the_loading_thread_ends_the_worker_at_once() -> None:
    """The kernel delivers a process's SIGINT to any of its threads; Python
    runs the handler in the main thread, which waits in the event loop and
    was not woken: the worker went on loading (in make test, past 60 s)."""
    done = subprocess.run(
        as_at_a_terminal([sys.executable, "-c", _SLOW_LOAD, *_WORKER_ARGS, "--self-interrupt"]),
        check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.rstrip().splitlines()[-1] == "gpu_worker: interrupted while starting"
    assert done.returncode == 130
