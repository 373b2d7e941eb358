"""Process control for the launcher: start a service module as a child process,
wait for its ready line, stop it (SIGTERM, then SIGKILL).

The stack and the gateway launcher both stop their children through
`stop_process`; the stack starts each service with `start_service`, which runs
`python -m module`, reads the child's stdout until the service announces its
address (`kvstash.common.rpc_server.announce_ready`), then keeps copying that
stdout into the service's log file so a chatty child never blocks on a full
pipe.

Each child dies with the launcher (Linux): `with_launcher` has it sent
SIGTERM when the launcher dies, even of a SIGKILL (the OOM killer, `kill -9`,
a CI runner's timeout), which no handler of the launcher's can catch; a
service stops cleanly on that SIGTERM (the cache unlinks its arena), freeing
its port for the next `kvstash up`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvstash.common.binding import join_address
from kvstash.common.rpc_server import READY_MARKER

# The name each service's module announces itself by when ready.
_ANNOUNCED = {"cache_svc": "cache", "gpu_worker": "worker", "scheduler_svc": "scheduler"}


@dataclass(slots=True)
class Service:
    """A running service process: `address` is what it announced (host:port)."""

    name: str
    process: subprocess.Popen[str]
    address: str
    log_path: Path
    module: str
    args: tuple[str, ...]  # as started; "--listen" may name port 0

    @property
    def metrics_url(self) -> str | None:
        """Where it serves /metrics, if it was started with --metrics-port."""
        port = self._flag("--metrics-port", "0")
        if port == "0":
            return None
        host = self._flag("--metrics-host", "127.0.0.1")
        return f"http://{join_address(host, int(port))}/metrics"

    def _flag(self, name: str, default: str) -> str:
        """The value of `name` as started (its last, as argparse takes it)."""
        for flag, value in reversed(list(zip(self.args, self.args[1:], strict=False))):
            if flag == name:
                return value
        return default

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_process(self.process, timeout_s)

    def kill(self) -> None:
        """SIGKILL, for fault tests."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self, flags: Mapping[str, str] | None = None) -> Service:
        """Stops this service and starts it again on the address it had;
        `flags` ({"--num-blocks": "48"}) replace values it was started with."""
        self.stop()
        args = list(self.args)
        for flag, value in {**(flags or {}), "--listen": self.address}.items():
            args[args.index(flag) + 1] = value
        return start_service(self.name, self.module, args, self.log_path.parent)


def stop_process(process: subprocess.Popen[Any], timeout_s: float) -> None:
    """SIGTERM; SIGKILL if still running after `timeout_s`."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_service(
    name: str, module: str, args: Sequence[str], log_dir: Path, timeout_s: float = 120.0
) -> Service:
    """Runs `python -m module args`, waits for its ready line, returns it running."""
    log_path = log_dir / f"{name}.log"
    log_path.write_text("")
    # Append mode for the child's stderr too: its lines and the stdout that
    # _copy appends then never overwrite each other.
    log_file = log_path.open("a")
    with stop_signals_held() as release:
        process = subprocess.Popen(
            with_launcher([sys.executable, "-m", module, *args]),
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log_file.close()
        assert process.stdout is not None
        try:
            release()  # a stop signal that came meanwhile acts here, the child known
            address = _wait_ready(name, _ANNOUNCED.get(module, name), process, process.stdout,
                                  log_path, timeout_s)
        except BaseException:  # not ready, or a stop signal while waiting
            process.kill()
            process.wait()
            raise
    # Keep draining stdout, into the log: a chatty child never blocks on a
    # full pipe, and what it prints (a console span exporter's output) is kept.
    threading.Thread(target=_copy, args=(process.stdout, log_path), daemon=True).start()
    return Service(name, process, address, log_path, module, tuple(args))


def with_launcher(argv: list[str]) -> list[str]:
    """`argv` run so that it is sent SIGTERM when this process dies
    (kvstash/launch/with_launcher.py). Linux only, and only from the main
    thread: the kernel signals the child when the *thread* that forked it
    ends, and a helper thread may end long before the launcher does.
    Elsewhere, `argv` as it is."""
    if not sys.platform.startswith("linux") or (
            threading.current_thread() is not threading.main_thread()):
        return argv
    return [sys.executable, "-m", "kvstash.launch.with_launcher", str(os.getpid()), *argv]


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How long a child whose stdout closed before its ready line may take to exit,
# so that its exit code is what gets reported.
_EXIT_WAIT_S = 5.0


@contextlib.contextmanager
def stop_signals_held() -> Iterator[Callable[[], None]]:
    """Holds the stop signals (their handlers may raise, as `kvstash up`'s
    do) until `release()` or the block's end, then acts on those that came:
    one handled inside Popen, or before its child is known, would leave the
    child running, and one handled while children are being stopped would
    leave the rest running. Only the main thread handles signals; elsewhere,
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    came: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, _: came.append(signum))
                for sig in _STOP_SIGNALS}

    def release() -> None:
        while handlers:
            signum, handler = handlers.popitem()
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        while came:
            signal.raise_signal(came.pop(0))

    try:
        yield release
    finally:
        release()


def _wait_ready(
    name: str, announced: str, process: subprocess.Popen[str], stdout: IO[str],
    log_path: Path, timeout_s: float,
) -> str:
    found: list[str] = []

    def read() -> None:
        for line in stdout:
            parts = line.split()
            if len(parts) == 3 and parts[0] == READY_MARKER and parts[1] == announced:
                found.append(parts[2])
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if found:
        return found[0]
    ended = not reader.is_alive()  # its stdout closed: it is exiting, if not reaped yet
    if ended:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(_EXIT_WAIT_S)
    code = process.poll()
    why = (f"exited with code {code}" if code is not None
           else "closed its output without a ready line" if ended
           else f"not ready in {timeout_s:.0f} s")
    tail = log_path.read_text()[-3000:]
    raise RuntimeError(f"{name} {why}; its log ({log_path}):\n{tail}")


def _copy(stdout: IO[str], log_path: Path) -> None:
    with contextlib.suppress(ValueError, OSError), log_path.open("a") as log:
        for line in stdout:
            log.write(line)
            log.flush()
