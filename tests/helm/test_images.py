"""docker/: the Dockerfile lints clean (no image is built here: no registry
that serves base images is reachable), agrees with the chart and with
pyproject.toml, and kvstash-health, the images' probe, works on a real
service."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import trustme
import yaml
from chart_helpers import CHART, INSTALL_HINT, REPO

from kvstash.common.binding import free_port

DOCKERFILE = REPO / "docker" / "Dockerfile"
HEALTH = REPO / "docker" / "kvstash-health"


def test_dockerfile_lints_clean() -> None:
    beside = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.fail(f"no hadolint binary: install the pinned one with {INSTALL_HINT}")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_images_agree_with_chart_and_pyproject() -> None:
    text = DOCKERFILE.read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    uids = set(re.findall(r"^ARG UID=(\d+)$", text, re.MULTILINE))
    assert uids == {str(values["runAsUser"])} == {str(values["runAsGroup"])}
    targets = set(re.findall(r"^FROM \S+ AS (\w+)$", text, re.MULTILINE))
    assert {"control", "worker", "gateway"} <= targets
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (torch_pin,) = [d for d in extras["worker"] if d.startswith("torch")]
    version = torch_pin.removeprefix("torch==")
    assert f"pytorch/pytorch:{version}-" in text and f"== '{version}'" in text
    # Everything the Dockerfile copies is in the build context .dockerignore leaves.
    allowed = (REPO / ".dockerignore").read_text()
    for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE):
        *sources, _destination = [w for w in line.split() if not w.startswith("--")]
        for source in sources:
            assert f"!{source.rstrip('/')}" in allowed.replace("/\n", "\n"), source


def stages(text: str) -> dict[str, str]:
    """Build stage name -> its lines (FROM to the next FROM)."""
    parts = re.split(r"^(?=FROM )", text, flags=re.MULTILINE)
    found = {}
    for part in parts:
        named = re.match(r"FROM (\S+) AS (\w+)$", part.splitlines()[0]) if part else None
        if named:
            found[named.group(2)] = part
    return found


def test_gateway_image_is_the_pinned_smg_without_torch_as_our_user() -> None:
    text = DOCKERFILE.read_text()
    by_name = stages(text)
    gateway = by_name["gateway"]
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (smg_pin,) = [d for d in extras["gateway"] if d.startswith("smg")]
    assert re.findall(r'pip install "(smg[^"]*)"', gateway) == [smg_pin]
    assert gateway.startswith("FROM slim AS gateway")  # python slim, no kvstash wheel
    assert by_name["slim"].startswith("FROM ${PYTHON_IMAGE} AS slim")
    assert "torch" not in gateway.lower() and "kvstash-" not in gateway  # no wheel, no torch
    assert "HF_ENDPOINT=http://127.0.0.1:9" in gateway  # as the chart and kvstash/launch/gateway.py
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    exposed = {int(p) for p in re.findall(r"^EXPOSE (.+)$", gateway, re.MULTILINE)[0].split()}
    assert exposed == {values["gateway"]["port"], values["metrics"]["ports"]["gateway"]}
    assert values["images"]["gateway"]["repository"] == "kvstash-gateway"
    # Every image the chart runs ends as the one non-root user.
    for target in ("control", "worker", "gateway"):
        users = re.findall(r"^USER (.+)$", by_name[target], re.MULTILINE)
        assert users == ["${UID}:${UID}"], target
        assert re.search(r"^ARG UID=\d+$", by_name[target], re.MULTILINE), target



def health(*args: str, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HEALTH), *args], capture_output=True, text=True,
                          timeout=60, check=False, env=environ)


def test_kvstash_health_reports_a_real_service() -> None:
    port = free_port()
    cache = subprocess.Popen(
        [sys.executable, "-m", "cache_svc", "--listen", f"127.0.0.1:{port}",
         "--memory-budget", "16MiB"], cwd=REPO, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        up = health(f"127.0.0.1:{port}", "--wait", "30")
        assert up.returncode == 0 and "SERVING" in up.stdout, up.stderr
        unknown = health(f"127.0.0.1:{port}", "--service", "kvstash.v1.Nope")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    finally:
        cache.terminate()
        cache.wait(timeout=30)
    started = time.monotonic()
    down = health(f"127.0.0.1:{port}", "--timeout", "1", "--wait", "1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
    assert time.monotonic() - started < 20


def without_proxies() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.lower() not in ("http_proxy", "https_proxy", "grpc_proxy", "no_proxy")}


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plaintext"])
def test_kvstash_health_ignores_a_proxy_in_the_environment(tls: bool, tmp_path: Path) -> None:
    """A pod's environment may name a proxy (http_proxy) for the internet;
    gRPC sends even a probe of 127.0.0.1 through it, so a proxy that cannot
    reach the pod failed every probe and the kubelet restarted serving
    containers forever. The probe goes straight to the address."""
    security: list[str] = []
    if tls:
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        for name, pem in (("ca.crt", ca.cert_pem), ("tls.crt", cert.cert_chain_pems[0]),
                          ("tls.key", cert.private_key_pem)):
            pem.write_to_path(str(tmp_path / name))
        # The chart's exec probe, as _helpers.tpl's kvstash.probes writes it.
        security = ["--tls-ca", str(tmp_path / "ca.crt"), "--tls-cert",
                    str(tmp_path / "tls.crt"), "--tls-key", str(tmp_path / "tls.key")]
    port = free_port()
    direct = without_proxies()
    cache = subprocess.Popen(
        [sys.executable, "-m", "cache_svc", "--listen", f"127.0.0.1:{port}",
         "--memory-budget", "16MiB", *security], cwd=REPO, env=direct,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        up = health(f"127.0.0.1:{port}", "--wait", "30", *security, environ=direct)
        assert up.returncode == 0, up.stderr
        dead_proxy = {**direct, "http_proxy": f"http://127.0.0.1:{free_port()}"}
        probe = health(f"127.0.0.1:{port}", "--timeout", "2", *security, environ=dead_proxy)
        assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stderr
    finally:
        cache.terminate()
        cache.wait(timeout=30)
