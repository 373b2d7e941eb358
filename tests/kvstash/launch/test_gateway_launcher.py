"""kvstash.launch.gateway without smg: a stand-in script shows how the launcher
handles a gateway that is missing, dies, never gets ready or ignores SIGTERM.
(tests/integration/test_gateway.py runs the real one.)"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvstash.launch import gateway
from kvstash.launch.stack import StackConfig, start_stack


def fake_smg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    script = tmp_path / "smg"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setattr(gateway, "smg_executable", lambda: str(script))


def test_a_missing_smg_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway.shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(FileNotFoundError, match=r"pip install 'kvstash\[gateway\]'"):
        gateway.smg_executable()


def test_bad_arguments_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="got 'fastest'"):
        gateway.start_gateway(["127.0.0.1:1"], tmp_path, policy="fastest")
    with pytest.raises(ValueError, match="at least one"):
        gateway.start_gateway([], tmp_path)


def test_a_gateway_that_exits_is_reported_with_its_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smg(tmp_path, monkeypatch, 'echo "args: $*"; echo "no workers answer" >&2; exit 3')
    with pytest.raises(RuntimeError, match="exited with code 3") as err:
        gateway.start_gateway(["127.0.0.1:1"], tmp_path)
    assert "no workers answer" in str(err.value)
    assert "--worker-urls grpc://127.0.0.1:1 --worker-startup-check-interval 1" in str(err.value)


def test_a_gateway_never_ready_is_stopped_at_the_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smg(tmp_path, monkeypatch, 'echo "waiting for $HF_ENDPOINT"; exec sleep 60')
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"not ready in 1 s") as err:
        gateway.start_gateway(["127.0.0.1:1"], tmp_path, startup_timeout_s=1)
    assert "waiting for http://127.0.0.1:9" in str(err.value)
    assert time.monotonic() - start < 10


def test_stop_kills_what_ignores_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smg(tmp_path, monkeypatch, "trap '' TERM; while :; do sleep 0.1; done")
    process = subprocess.Popen([gateway.smg_executable()])
    running = gateway.Gateway("http://127.0.0.1:1", process, tmp_path / "smg.log",
                              "http://127.0.0.1:2/metrics")
    time.sleep(0.3)  # the trap is set
    running.stop(timeout_s=0.5)
    assert process.returncode == -signal.SIGKILL


def test_a_stack_checks_for_smg_before_starting_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without smg (or with a policy it lacks), `kvstash up --gateway` fails at
    once, not after every worker has loaded its model."""
    monkeypatch.setattr(gateway.shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(FileNotFoundError, match="smg"):
        start_stack(StackConfig(gateway=True), tmp_path)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="got 'fastest'"):
        start_stack(StackConfig(gateway=True, gateway_policy="fastest"), tmp_path)
    assert not list(tmp_path.iterdir())  # no service started, so no log either


def test_smgs_log_is_plain_text_and_its_metrics_stay_on_its_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """smg colours its console output whatever it writes to; smg.log gets the
    text without the codes. Its /metrics listens on the gateway's host."""
    fake_smg(tmp_path, monkeypatch,
             r'printf "\033[2m2026-11-25\033[0m \033[32m INFO\033[0m args: %s\n" "$*"; exit 3')
    with pytest.raises(RuntimeError, match="exited with code 3") as err:
        gateway.start_gateway(["127.0.0.1:1"], tmp_path, host="127.0.0.1")
    log = (tmp_path / "smg.log").read_text()
    assert "\x1b" not in log and "\x1b" not in str(err.value)
    assert log.startswith("2026-11-25  INFO args: launch --host 127.0.0.1 --port ")
    assert "--prometheus-host 127.0.0.1 --prometheus-port " in log
