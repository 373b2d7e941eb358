"""Runs the Shepherd Model Gateway (smg) in front of kvstash schedulers.

smg speaks OpenAI HTTP to clients and vllm.grpc.engine.VllmEngine to the
schedulers (which serve it on their own port), routing by prefix with its
cache-aware policy fed by their KV events:

    HTTP clients --> smg --grpc://--> scheduler(s) --> worker(s)

    with running_gateway([stack.address], log_dir) as gateway:
        urlopen(f"{gateway.url}/v1/completions", ...)

smg is an optional dependency (`pip install kvstash[gateway]`): a Rust binary
in a wheel, no torch. It never looks anything up on Hugging Face here: the
tokenizer comes from each scheduler's GetTokenizer.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kvstash.common.binding import free_port, join_address
from kvstash.launch.openai_http import open_direct
from kvstash.launch.processes import stop_process, stop_signals_held, with_launcher

# smg 1.13.0's --policy choices.
POLICIES = ("random", "round_robin", "passthrough", "cache_aware", "power_of_two",
            "least_load", "manual", "consistent_hashing", "prefix_hash")
# An address nothing answers on: any Hugging Face lookup fails at once.
_NO_HUB = "http://127.0.0.1:9"
# smg 1.13 colours its console log whatever it writes to (its logging sets
# ANSI on, no flag or NO_COLOR turns it off): these codes never reach smg.log.
_ANSI = re.compile(rb"\x1b\[[0-9;]*m")


@dataclass(frozen=True, slots=True)
class Gateway:
    """A running smg process; `url` is its base URL (http://host:port)."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path  # smg's stdout and stderr, without colour codes
    metrics_url: str  # smg's own Prometheus /metrics, on the same host
    # Copies smg's output into log_path; ends when smg exits.
    copier: threading.Thread | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return "gateway"

    @property
    def address(self) -> str:
        return self.url.removeprefix("http://")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM; SIGKILL if still running after `timeout_s`."""
        stop_process(self.process, timeout_s)


def smg_executable() -> str:
    """The smg next to this Python (its virtual environment) or on PATH."""
    found = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
    if found is None:
        raise FileNotFoundError("smg (the Shepherd Model Gateway) is not installed: "
                                "pip install 'kvstash[gateway]'")
    return found


def check_gateway(policy: str) -> None:
    """FileNotFoundError without smg, ValueError for a policy it lacks."""
    smg_executable()
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def start_gateway(addresses: Sequence[str], log_dir: Path, *, host: str = "127.0.0.1",
                  port: int = 0, policy: str = "cache_aware", health_check_interval_s: int = 5,
                  startup_timeout_s: float = 60.0) -> Gateway:
    """Starts smg in front of the schedulers at `addresses` (host:port, or a
    grpc:// URL) and returns it once GET /readiness answers 200. `host` is an
    IP address (IPv6 without brackets; its URLs put them in), where smg serves
    HTTP and its Prometheus /metrics (each on a free port; `port` picks the
    HTTP one); smg checks each instance's health every `health_check_interval_s`.
    Raises RuntimeError with the tail of its log (log_dir/smg.log) if it exits
    or is not ready in `startup_timeout_s`."""
    if not addresses:
        raise ValueError("no scheduler addresses: smg needs at least one")
    check_gateway(policy)
    port = port or free_port(host)
    prometheus_port = free_port(host)
    log_path = log_dir / "smg.log"
    log_path.write_bytes(b"")
    # Signals held, as processes.start_service holds them: a stop handled
    # inside Popen, or before the try below, would leave smg running.
    with stop_signals_held() as release:
        process = subprocess.Popen(
            with_launcher([smg_executable(), "launch", "--host", host, "--port", str(port),
             # smg's default is every interface: keep it where the HTTP API is.
             "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
             "--policy", policy,
             "--worker-urls", *[a if "://" in a else f"grpc://{a}" for a in addresses],
             "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "1",
             # An instance that stops answering leaves the rotation after two
             # failed checks (until it answers twice again), not smg's 3 x 60 s.
             "--health-check-interval-secs", str(health_check_interval_s),
             "--health-failure-threshold", "2"]),
            env={**os.environ, "HF_ENDPOINT": _NO_HUB}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        try:
            assert process.stdout is not None
            copier = threading.Thread(target=_copy_plain, args=(process.stdout, log_path),
                                      daemon=True)
            copier.start()
            gateway = Gateway(f"http://{join_address(host, port)}", process, log_path,
                              f"http://{join_address(host, prometheus_port)}/metrics", copier)
            release()  # a stop signal that came meanwhile acts here, smg known
            _wait_ready(gateway, startup_timeout_s)
        except BaseException:  # not ready, or a stop signal
            process.kill()
            process.wait()
            raise
    return gateway


@contextlib.contextmanager
def running_gateway(addresses: Sequence[str], log_dir: Path, *, host: str = "127.0.0.1",
                    port: int = 0, policy: str = "cache_aware", health_check_interval_s: int = 5,
                    startup_timeout_s: float = 60.0) -> Iterator[Gateway]:
    """start_gateway(...) for the `with` block; stopped at its end."""
    gateway = start_gateway(addresses, log_dir, host=host, port=port, policy=policy,
                            health_check_interval_s=health_check_interval_s,
                            startup_timeout_s=startup_timeout_s)
    try:
        yield gateway
    finally:
        gateway.stop()


def _wait_ready(gateway: Gateway, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        # Refused, an HTTP error status (urllib raises it as an OSError), or
        # no HTTP at all (HTTPException): another server on the port, not smg.
        with contextlib.suppress(OSError, http.client.HTTPException), open_direct(
                f"{gateway.url}/readiness", timeout=2) as reply:
            if reply.status == 200:
                return
        code = gateway.process.poll()
        if code is not None and gateway.copier is not None:
            gateway.copier.join(2.0)  # its last lines, on their way to the log
        if code is not None or time.monotonic() > deadline:
            why = f"exited with code {code}" if code is not None else (
                f"not ready in {timeout_s:.0f} s")
            tail = gateway.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"smg {why}; its log ({gateway.log_path}):\n{tail}")
        time.sleep(0.2)


def _copy_plain(output: IO[bytes], log_path: Path) -> None:
    """Appends what smg prints to its log, colour codes removed, until it exits."""
    with contextlib.suppress(ValueError, OSError), log_path.open("ab") as log:
        for line in output:
            log.write(_ANSI.sub(b"", line))
            log.flush()

