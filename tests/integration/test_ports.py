"""A port in use is refused by every process that binds a fixed one: each
service alone, and `kvstash up` before it starts anything. gRPC would share
the port otherwise (SO_REUSEPORT), and requests would alternate at random
between the old server and the new one."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstash.launch.processes import Service, start_service

IN_USE = "the address is in use (another kvstash stack or another program listens there)"


@pytest.fixture(scope="module")
def taken(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A real cache service, holding its port."""
    service = start_service("cache", "cache_svc", ["--listen", "127.0.0.1:0"],
                            tmp_path_factory.mktemp("first"))
    yield service
    service.stop()


def still_serves(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvstash.v1.KVCache"), timeout=10)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize("module", ["cache_svc", "scheduler_svc", "gpu_worker"])
def test_a_service_on_a_taken_port_exits_with_one_line(taken: Service, module: str) -> None:
    done = run(module, "--listen", taken.address)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [f"{module}: cannot listen on {taken.address}: {IN_USE}"]
    assert still_serves(taken.address)


@pytest.mark.parametrize("module", ["cache_svc", "gpu_worker"])
def test_a_service_on_a_taken_metrics_port_exits_with_one_line(
    taken: Service, module: str, tmp_path: Path,
) -> None:
    """The cache binds /metrics once its store (and arena) and gRPC server
    are up: they are closed again, so no arena file stays behind and no
    traceback of a server left running follows the line."""
    port = taken.address.rsplit(":", 1)[1]
    arena = ("--arena-dir", str(tmp_path), "--memory-budget", "64MiB")
    done = run(module, "--listen", "127.0.0.1:0", "--metrics-port", port,
               *(arena if module == "cache_svc" else ()))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"{module}: cannot listen on {taken.address} (/metrics): {IN_USE}"]
    assert list(tmp_path.iterdir()) == []
    assert still_serves(taken.address)


def test_up_on_a_taken_port_starts_nothing(taken: Service, tmp_path: Path) -> None:
    start = time.monotonic()
    done = run("kvstash.launch.cli", "up", "--listen", taken.address,
               "--log-dir", str(tmp_path / "logs"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"kvstash up: cannot listen on {taken.address}: {IN_USE}"]
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").iterdir())
    assert time.monotonic() - start < 60  # no worker loaded a model first
    assert still_serves(taken.address)


def test_up_with_its_gateway_port_taken_starts_nothing(taken: Service, tmp_path: Path) -> None:
    port = taken.address.rsplit(":", 1)[1]
    done = run("kvstash.launch.cli", "up", "--listen", "127.0.0.1:0", "--gateway",
               "--gateway-port", port, "--log-dir", str(tmp_path / "logs"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"kvstash up: cannot listen on {taken.address}: {IN_USE}"]
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").iterdir())
    assert still_serves(taken.address)
