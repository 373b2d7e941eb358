"""The instance pod the chart renders, run as three processes here: each
container's command with exactly its environment, moved to loopback ports
and a local arena directory, then what `helm test` does (health, then one
generation through the arena-sharing stack)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from chart_helpers import REPO, container, env, instances, render

from kvstash.stack import Service, start_service

MODULES = {"cache": "cache_svc", "worker": "gpu_worker", "scheduler": "scheduler_svc"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_rendered_pod_serves_a_generation(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render({"cache": {"memoryBudget": "64Mi"}}, tmp_path)
    pod = instances(docs)["spec"]["template"]["spec"]
    containers = {name: container(pod, name) for name in MODULES}
    # The pod's ports and arena directory, as this machine has them free.
    moved = {f"0.0.0.0:{p}": f"127.0.0.1:{free_port()}" for p in (50051, 50061, 50071)}
    moved |= {f"127.0.0.1:{p}": moved[f"0.0.0.0:{p}"] for p in (50061, 50071)}
    cache_mounts = containers["cache"]["volumeMounts"]
    arena_dir = next(m["mountPath"] for m in cache_mounts if m["name"] == "arena")
    moved[arena_dir] = str(tmp_path / "arena")
    for name in list(os.environ):
        if name.startswith(("KVSTASH_", "OTEL_")):
            monkeypatch.delenv(name)
    services: list[Service] = []
    try:
        for name, module in MODULES.items():
            c = containers[name]
            assert c["command"] == ["python", "-m", module]
            for key, value in env(c).items():
                monkeypatch.setenv(key, moved.get(value, value))
            services.append(start_service(name, module, [], tmp_path))
            for key in env(c):
                monkeypatch.delenv(key)
        scheduler = moved["0.0.0.0:50051"]
        health = subprocess.run(
            [sys.executable, str(REPO / "docker" / "kvstash-health"), scheduler, "--wait", "60"],
            capture_output=True, text=True, timeout=120, check=False)
        assert health.returncode == 0, health.stderr
        generated = subprocess.run(
            [sys.executable, "-m", "kvstash.cli", "generate", "Once upon a time",
             "--address", scheduler, "--max-tokens", "8"],
            capture_output=True, text=True, timeout=120, check=False)
        assert generated.returncode == 0, generated.stderr
        assert generated.stdout.strip()
        # The cache put its arena where the worker looks for it.
        (arena_file,) = (tmp_path / "arena").iterdir()
        assert arena_file.name.startswith("kvstash-arena-")
    finally:
        for service in reversed(services):
            service.stop()
