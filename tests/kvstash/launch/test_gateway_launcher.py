"""kvstash.launch.gateway without smg: a stand-in script shows how the launcher
handles a gateway that is missing, dies, never gets ready or ignores SIGTERM.
(tests/integration/test_gateway.py runs the real one.)"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvstash.launch import gateway
from kvstash.launch.openai_http import request_json, stream_completion
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


def test_a_port_that_answers_no_http_is_not_smg_being_ready(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """smg cannot have its port (`kvstash up --listen 127.0.0.1:P --gateway
    --gateway-port P`: the scheduler holds it, and answers HTTP/2): the
    launcher's readiness check got no HTTP status line and `kvstash up`
    ended in a traceback (http.client.BadStatusLine), not smg's exit."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()

        def answer() -> None:
            while True:
                try:
                    connection, _ = other.accept()
                except OSError:  # closed: the test is over
                    return
                with connection:
                    connection.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\r\n")

        threading.Thread(target=answer, daemon=True).start()
        fake_smg(tmp_path, monkeypatch, 'echo "address in use" >&2; sleep 1; exit 1')
        with pytest.raises(RuntimeError, match="smg exited with code 1") as err:
            gateway.start_gateway(["127.0.0.1:1"], tmp_path, port=other.getsockname()[1])
    assert "address in use" in str(err.value)


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


# A stand-in smg that serves HTTP where it is told (--host, --port): 200 to
# any GET, and one streamed completion to a POST.
HTTP_SMG = """
import http.server, json, socket, sys
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps({"path": self.path}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Connection", "close")
        self.end_headers()
        event = {"choices": [{"text": "hi", "finish_reason": "length"}],
                 "usage": {"completion_tokens": 1}}
        self.wfile.write(f"data: {json.dumps(event)}\\n\\ndata: [DONE]\\n\\n".encode())

class Server(http.server.HTTPServer):
    address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

Server((host, port), Handler).serve_forever()
"""


def test_a_gateway_on_ipv6_has_urls_that_clients_can_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvstash up --listen [::1]:PORT --gateway`: its URLs were
    http://::1:PORT, which an HTTP client cannot parse (the streams of the
    demo and the benchmarks failed on it, ValueError)."""
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback")
    (tmp_path / "smg.py").write_text(HTTP_SMG)
    fake_smg(tmp_path, monkeypatch, f'exec {sys.executable} {tmp_path / "smg.py"} "$@"')
    running = gateway.start_gateway(["[::1]:1"], tmp_path, host="::1", startup_timeout_s=60)
    try:
        assert running.url == f"http://[::1]:{running.url.rpartition(':')[2]}"
        assert running.metrics_url.startswith("http://[::1]:")
        assert request_json(f"{running.url}/v1/models") == {"path": "/v1/models"}
        done = asyncio.run(stream_completion(running.url, {"prompt": "x"}))
        assert (done.text, done.completion_tokens) == ("hi", 1)
    finally:
        running.stop()
