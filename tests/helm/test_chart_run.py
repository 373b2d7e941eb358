"""The pods the chart renders, run as processes here: each container's
command with exactly its environment (and arguments), moved to loopback
ports and a local arena directory, then what `helm test` does: health, then
one generation through the arena-sharing stack; with the gateway on, smg
finding that instance through a fake Kubernetes API, as its Role lets it,
and the helm test's HTTP check through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from chart_helpers import REPO, container, env, instances, one, pod_labels, render, workloads
from fake_kubernetes import FakeKubernetes, ready_pod

from kvstash.common.binding import free_port
from kvstash.launch.gateway import smg_executable
from kvstash.launch.processes import Service, start_service, stop_process

MODULES = {"cache": "cache_svc", "worker": "gpu_worker", "scheduler": "scheduler_svc"}



def start_instance_pod(pod: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       services: list[Service]) -> str:
    """Starts the pod's cache, worker and scheduler (each appended to
    `services` once up); returns the scheduler's address."""
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
    for name, module in MODULES.items():
        c = containers[name]
        assert c["command"] == ["python", "-m", module]
        for key, value in env(c).items():
            monkeypatch.setenv(key, moved.get(value, value))
        services.append(start_service(name, module, [], tmp_path))
        for key in env(c):
            monkeypatch.delenv(key)
    return moved["0.0.0.0:50051"]


def test_rendered_pod_serves_a_generation(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render({"cache": {"memoryBudget": "64Mi"}}, tmp_path)
    pod = instances(docs)["spec"]["template"]["spec"]
    services: list[Service] = []
    try:
        scheduler = start_instance_pod(pod, tmp_path, monkeypatch, services)
        health = subprocess.run(
            [sys.executable, str(REPO / "docker" / "kvstash-health"), scheduler, "--wait", "60"],
            capture_output=True, text=True, timeout=120, check=False)
        assert health.returncode == 0, health.stderr
        generated = subprocess.run(
            [sys.executable, "-m", "kvstash.launch.cli", "generate", "Once upon a time",
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


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with the value after `flag` replaced."""
    at = args.index(flag) + 1
    return [*args[:at], value, *args[at + 1:]]


def test_rendered_gateway_discovers_the_pod_and_passes_helm_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway container's command and arguments, its ports moved, finds
    the rendered instance pod by its template's labels through a fake API
    server that grants only what the chart's Role does; the helm test pod's
    gateway check then passes against it."""
    docs = render({"cache": {"memoryBudget": "64Mi"}, "gateway": {"enabled": True}}, tmp_path)
    instance = instances(docs)
    (deployment,) = workloads(docs, "gateway")
    gateway = container(deployment["spec"]["template"]["spec"], "gateway")
    check = container(one(docs, "Pod")["spec"], "gateway")
    services: list[Service] = []
    smg = None
    log_path = tmp_path / "smg.log"
    try:
        scheduler = start_instance_pod(instance["spec"]["template"]["spec"], tmp_path,
                                       monkeypatch, services)
        host, scheduler_port = scheduler.rsplit(":", 1)
        # A pod of another pool that the selector smg sends must leave out.
        stranger = ready_pod("rel-kvstash-decode-0", "kv", {**pod_labels(instance),
                                                            "kvstash.io/role": "decode"},
                             "127.0.0.2")
        pod = ready_pod("rel-kvstash-5d8f-x2x4z", "kv", pod_labels(instance), host)
        with FakeKubernetes("kv", [pod, stranger]) as api:
            port = free_port()
            args = with_flag(gateway["args"], "--port", str(port))
            args = with_flag(args, "--prometheus-port", str(free_port()))
            args = with_flag(args, "--service-discovery-port", scheduler_port)
            variables = {k: v for k, v in os.environ.items()
                         if not k.startswith("KUBERNETES_")}  # no in-cluster config here
            variables |= env(gateway) | {"KUBECONFIG": str(api.write_kubeconfig(tmp_path))}
            assert gateway["command"][0] == "smg"
            with log_path.open("wb") as log:
                smg = subprocess.Popen([smg_executable(), *gateway["command"][1:], *args],
                                       env=variables, stdout=log, stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"
            done = subprocess.run(
                [sys.executable, "-c", check["command"][-1]],
                env={**env(check), "GATEWAY_URL": url, "WAIT_SECONDS": "60"},
                capture_output=True, text=True, timeout=180, check=False)
            assert done.returncode == 0, (done.stdout + done.stderr
                                          + log_path.read_text(errors="replace")[-3000:])
            assert "tokens" in done.stdout
            with urllib.request.urlopen(f"{url}/workers", timeout=10) as reply:
                workers = json.load(reply)["workers"]
            assert [w["url"] for w in workers] == [f"grpc://{scheduler}"]
        # The selector smg sent took the instance pod alone; it asked for no
        # more than the Role grants: the pods of the release's namespace, read.
        assert api.listed == {pod["metadata"]["name"]}
        assert api.requests and all(
            method == "GET" and path.startswith("/api/v1/namespaces/kv/pods?")
            for method, path in api.requests), api.requests
    finally:
        if smg is not None:
            stop_process(smg, timeout_s=15)
        for service in reversed(services):
            service.stop()
