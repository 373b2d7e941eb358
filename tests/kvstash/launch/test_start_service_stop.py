"""Starting a stack's processes: a stop signal that lands as one is being
created (inside Popen, or before the launcher holds the child), or while a
failed start stops what had started, must still stop every child: `kvstash
up` stopped while starting leaves nothing behind. Each case runs in a
process of its own, whose SIGTERM handler raises as `kvstash up`'s does.
Also what a start that fails reports, how long a start may take, and the
flags the stack starts its cache with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstash.launch import cli, processes, stack
from kvstash.launch.stack import StackConfig, disk_args, running_stack, start_stack
from tests.gpu_worker.worker_factories import REPO

PRELUDE = """
import os, signal, subprocess, sys, tempfile, time
from pathlib import Path
from kvstash.launch import gateway, processes, stack

class Stop(Exception):
    pass

def stop(signum, frame):
    raise Stop()

signal.signal(signal.SIGTERM, stop)

def then_stopped(call):
    # `call`, then a stop signal lands (as the child it made exists).
    def called(*args, **kwargs):
        result = call(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return result
    return called

def sleeper():  # a child that holds none of our pipes
    return subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)

def fake_service(name, module, args, log_dir, timeout_s=120.0, kind=processes.Service):
    return kind(name, sleeper(), "127.0.0.1:1", log_dir / f"{name}.log", module, tuple(args))

def children():
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(stat.parent.name)
    return found

tempfile.tempdir = tempfile.mkdtemp()  # where a stack makes its data directory
try:
    START
except Stop:
    print("stopped")
print("children", len(children()), "left", len(list(Path(tempfile.tempdir).glob("kvstash-*"))))
"""

SERVICE = """
processes.subprocess.Popen = then_stopped(processes.subprocess.Popen)
processes.start_service("cache", "cache_svc", ["--listen", "127.0.0.1:0"],
                        Path(tempfile.mkdtemp()))
"""

GATEWAY = """
smg = Path(tempfile.mkdtemp()) / "smg"
smg.write_text("#!/bin/sh\\nexec sleep 60\\n")
smg.chmod(0o755)
gateway.smg_executable = lambda: str(smg)
gateway.subprocess.Popen = then_stopped(gateway.subprocess.Popen)
gateway.start_gateway(["127.0.0.1:1"], smg.parent)
"""

# The first stop lands while the scheduler starts; a second one as the
# worker is being stopped.
STACK_STOPPED_TWICE = """
class StoppedAgain(processes.Service):
    def stop(self, timeout_s=10.0):
        os.kill(os.getpid(), signal.SIGTERM)
        super().stop(timeout_s)

def start_service(name, module, args, log_dir, timeout_s=120.0):
    if module == "scheduler_svc":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises here
    kind = StoppedAgain if module == "gpu_worker" else processes.Service
    return fake_service(name, module, args, log_dir, kind=kind)

stack.start_service = start_service
stack.start_stack(stack.StackConfig(cache_arena=False), Path(tempfile.mkdtemp()))
"""

# Everything up, smg too: the stop lands as the stack is returned.
STACK_WITH_SMG = """
stack.start_service = fake_service
stack.check_gateway = lambda policy: None
stack.start_gateway = lambda addresses, logs, **kwargs: gateway.Gateway(
    "http://127.0.0.1:1", sleeper(), logs / "smg.log", "http://127.0.0.1:2/metrics")
stack.Stack = then_stopped(stack.Stack)
stack.start_stack(stack.StackConfig(cache_arena=False, gateway=True), Path(tempfile.mkdtemp()))
"""


@pytest.mark.parametrize("start", [SERVICE, GATEWAY, STACK_STOPPED_TWICE, STACK_WITH_SMG],
                         ids=["service", "smg", "stack stopped twice", "stack with smg"])
def test_a_stop_while_starting_leaves_no_child_and_no_data(start: str) -> None:
    script = PRELUDE.replace("    START\n", "".join(
        f"    {line}\n" for line in start.strip().splitlines()))
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["stopped", "children", "0", "left", "0"], done.stdout


@pytest.mark.parametrize(("rest", "exit_wait_s", "why"), [
    ("time.sleep(1)\nos._exit(3)", 30.0, "exited with code 3"),
    ("time.sleep(60)", 0.5, "closed its output without a ready line"),
], ids=["exits", "runs on"])
def test_a_service_that_closes_its_output_unready_is_reported_as_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rest: str, exit_wait_s: float, why: str,
) -> None:
    """Its output ends a moment before it is reaped: that is an exit (with
    its code), not a service "not ready in 120 s" at once."""
    (tmp_path / "unready.py").write_text(f"import os, time\nos.close(1)\n{rest}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(processes, "_EXIT_WAIT_S", exit_wait_s)
    with pytest.raises(RuntimeError, match=f"^worker {why}; its log"):
        processes.start_service("worker", "unready", [], tmp_path, timeout_s=120)


def test_start_timeout_reaches_every_service_the_stack_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kvstash up --start-timeout 10m`: a worker loading a large checkpoint
    may take longer than the 120 s default to be ready."""
    started: list[StackConfig] = []

    def recorded(config: StackConfig, log_dir: Path | None = None) -> stack.Stack:
        started.append(config)
        raise RuntimeError("not started")

    monkeypatch.setattr(cli, "_stop_on_signals", lambda: None)
    monkeypatch.setattr(cli, "start_stack", recorded)
    assert cli.main(["up", "--start-timeout", "10m", "--log-dir", str(tmp_path)]) == 2
    assert started[0].start_timeout_s == 600
    with pytest.raises(ValueError, match="start_timeout_s must be > 0, got 0"):
        StackConfig(start_timeout_s=0)

    timeouts: list[float] = []

    def service(name: str, module: str, args: list[str], log_dir: Path,
                timeout_s: float = 120.0) -> processes.Service:
        timeouts.append(timeout_s)
        return processes.Service(name, subprocess.Popen(["sleep", "60"], text=True),
                                 "127.0.0.1:1", log_dir / f"{name}.log", module, tuple(args))

    monkeypatch.setattr(stack, "start_service", service)
    start_stack(StackConfig(start_timeout_s=600, pd=True), tmp_path).stop()
    assert timeouts == [600] * 5  # the cache, and each instance's worker and scheduler


def test_a_log_dir_not_there_is_made_and_one_that_cannot_be_is_refused(tmp_path: Path) -> None:
    """start_stack given a log directory that does not exist yet makes it, as
    `kvstash up --log-dir` does (it raised a bare FileNotFoundError, from the
    cache's log); one that cannot be a directory is refused by name before
    anything starts."""
    logs = tmp_path / "runs" / "1"
    with running_stack(StackConfig(num_blocks=16, cache_arena=False), logs) as started:
        assert started.log_dir == logs
    assert sorted(p.name for p in logs.iterdir()) == ["cache.log", "scheduler.log", "worker.log"]
    (tmp_path / "a-file").write_text("")
    with pytest.raises(OSError, match=f"^log directory {tmp_path}/a-file: File exists$"):
        start_stack(StackConfig(), tmp_path / "a-file")


def test_a_disk_budget_of_0_starts_the_cache_without_a_disk_tier() -> None:
    """The cache refuses a --disk-dir without a budget (a tier of 0 bytes
    would evict, at start, all it finds there): `kvstash up
    --cache-disk-budget 0` gives it neither; a directory given is passed on,
    for the cache to refuse by name."""
    assert disk_args(StackConfig(cache_disk_budget="0"), "/tmp/run") == []
    assert disk_args(StackConfig(), "/tmp/run") == [
        "--disk-dir", "/tmp/run/cache", "--disk-budget", "4GiB"]
    assert disk_args(StackConfig(cache_disk_budget="0", cache_disk_dir="/data"), "/tmp/run") == [
        "--disk-dir", "/data", "--disk-budget", "0"]


def test_no_at_fork_handler_runs_in_a_services_child() -> None:
    """A launcher's children are made without running Python's at-fork
    handlers: gRPC's, run in a child of a launcher with channels open,
    crashed it now and then (SIGSEGV, SIGABRT: 2-4 children of 300 in a
    loop), as Popen's preexec_fn (the parent-death signal was once set
    there) makes them run. The child still dies with the launcher."""
    script = """
import os, sys, tempfile
from pathlib import Path
from kvstash.launch import processes
marker = Path(tempfile.mkdtemp()) / "forked"
os.register_at_fork(after_in_child=lambda: marker.touch())
service = processes.start_service("cache", "cache_svc", [
    "--listen", "127.0.0.1:0", "--memory-budget", "16MiB", "--disk-budget", "0"],
    marker.parent)
try:
    cmdline = Path(f"/proc/{service.process.pid}/cmdline").read_text().split("\\0")
    print(marker.exists(), "cache_svc" in cmdline, flush=True)
finally:
    service.stop()
"""
    done = subprocess.run([sys.executable, "-c", script], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"], done.stderr
