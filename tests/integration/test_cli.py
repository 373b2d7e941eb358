"""The `kvstash` command as users run it."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstash.client import Client
from kvstash.launch.data_dir import remove_stale
from kvstash.launch.openai_http import request_json
from kvstash.launch.stack import Stack, StackConfig, running_stack
from tests.process_helpers import child_pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone once reaped or marked Z.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@dataclass(slots=True)
class Up:
    """A running `kvstash up` and what it printed about its services."""

    process: subprocess.Popen[str]
    services: dict[str, tuple[str, int]]  # name -> (address, pid)
    log_dir: Path
    printed: list[str]  # stdout up to the line naming the logs

    @property
    def pids(self) -> list[int]:
        return [pid for _, pid in self.services.values()]


# Execs the rest of its command line with SIGINT ignored, as a shell script
# starts a background job (`kvstash up &`).
SIGINT_IGNORED = ("-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def start_up(*extra: str, sigint_ignored: bool = False) -> Up:
    """`kvstash up` with `extra` flags; with `sigint_ignored`, SIGINT
    inherited as ignored."""
    process = subprocess.Popen(
        [sys.executable, *(SIGINT_IGNORED if sigint_ignored else ()), "-m",
         "kvstash.launch.cli", "up", "--listen", "127.0.0.1:0", "--num-blocks", "64", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert process.stdout is not None
    services: dict[str, tuple[str, int]] = {}
    printed: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        printed.append(line.rstrip("\n"))
        if match := re.match(r"([\w-]+)\s+(\S+:\d+)\s+pid (\d+)", line):
            services[match[1]] = (match[2], int(match[3]))
        if match := re.match(r"logs in (\S+);", line):
            break
    expected = {"cache", "worker", "scheduler"}
    if "--pd" in extra:
        expected |= {"decode-worker", "decode-scheduler"}
    if "--instances" in extra:
        for k in range(2, int(extra[extra.index("--instances") + 1]) + 1):
            expected |= {f"instance{k}-worker", f"instance{k}-scheduler"}
    if "--gateway" in extra:
        expected.add("gateway")
    assert set(services) == expected, services
    assert match is not None
    return Up(process, services, Path(match[1]), printed)


def wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


@pytest.mark.parametrize(("sig", "sigint_ignored"), [
    (signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGHUP, False),
    (signal.SIGINT, True),  # `kvstash up &` in a script, then kill -INT
])
def test_up_serves_then_a_stop_signal_leaves_nothing_behind(
    sig: signal.Signals, sigint_ignored: bool,
) -> None:
    up = start_up(sigint_ignored=sigint_ignored)

    async def call() -> list[int]:
        async with Client(up.services["scheduler"][0]) as client:
            return (await client.complete([1, 2, 3], max_tokens=4, ignore_eos=True)).token_ids

    assert len(asyncio.run(call())) == 4
    assert all(_alive(pid) for pid in up.pids)

    up.process.send_signal(sig)  # Ctrl-C, a service manager, a closed terminal
    assert up.process.wait(30) == 0
    assert not wait_gone(up.pids)
    # The logs outlive the stack, and the last line says where they are.
    assert up.process.stderr is not None
    assert up.process.stderr.read().splitlines()[-1] == f"stopped; logs kept in {up.log_dir}"
    assert {p.name for p in up.log_dir.iterdir()} == {"cache.log", "worker.log",
                                                      "scheduler.log"}
    shutil.rmtree(up.log_dir)


def test_up_stops_everything_when_nobody_reads_what_it_says() -> None:
    """A closed terminal (SIGHUP) or a parent gone: the lines `kvstash up`
    writes as it stops fail, and the stopping goes on regardless."""
    up = start_up()
    assert up.process.stdout is not None and up.process.stderr is not None
    up.process.stdout.close()
    up.process.stderr.close()
    up.process.send_signal(signal.SIGHUP)
    assert up.process.wait(30) == 0
    assert not wait_gone(up.pids)
    shutil.rmtree(up.log_dir)


def test_up_killed_outright_leaves_no_service_running() -> None:
    """SIGKILL (the OOM killer, `kill -9`, a CI runner's timeout) runs no
    handler of `kvstash up`'s: each service (smg too) is sent SIGTERM as it
    dies, and stops cleanly; the cache unlinks its arena, and the next
    launcher removes the data directory."""
    up = start_up("--gateway", "--gateway-port", "0")
    cache = up.services["cache"][1]
    arenas = [Path(os.readlink(fd)) for fd in Path(f"/proc/{cache}/fd").iterdir()
              if os.readlink(fd).startswith("/dev/shm/")]
    assert arenas
    cache_args = Path(f"/proc/{cache}/cmdline").read_text().split("\0")
    data_dir = Path(cache_args[cache_args.index("--disk-dir") + 1]).parent

    up.process.kill()
    up.process.wait(30)
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in up.pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [name for name, (_, pid) in up.services.items() if _alive(pid)]
    for name in left:  # not to hold ports and memory after a failure
        os.kill(up.services[name][1], signal.SIGKILL)
    kept = [arena for arena in arenas if arena.exists()]
    for arena in kept:
        arena.unlink()
    assert not left
    assert not kept
    # The data directory, which only a launcher removes: the next one does.
    assert data_dir.is_dir()
    remove_stale(data_dir.parent)
    assert not data_dir.exists()
    shutil.rmtree(up.log_dir)


@pytest.mark.parametrize("command", [("generate", "Once upon a time", "--max-tokens", "32"),
                                     ("stats",)])
def test_a_reader_gone_ends_a_command_quietly(stack: Stack, command: tuple[str, ...]) -> None:
    """`kvstash generate ... | head -c 5`, `kvstash stats | true`: the
    reader's end of the pipe closes before (or while) the command writes;
    it ends with status 1 and says nothing (it said `[Errno 32] Broken
    pipe` and exited 2)."""
    done = subprocess.Popen(
        [sys.executable, "-m", "kvstash.launch.cli", *command, "--address", stack.address],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert done.stdout is not None
    done.stdout.close()  # the reader goes away
    _, err = done.communicate(timeout=120)
    assert (done.returncode, err) == (1, "")


def test_up_writes_its_logs_to_log_dir_and_keeps_them(tmp_path: Path) -> None:
    up = start_up("--log-dir", str(tmp_path / "logs"))
    assert up.log_dir == tmp_path / "logs"
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(30) == 0
    assert not wait_gone(up.pids)
    assert "listening on port" in (up.log_dir / "scheduler.log").read_text()
    # Without --metrics, one line says how to have them.
    assert any("kvstash up --metrics" in line for line in up.printed)


def test_up_pd_hands_requests_to_its_decode_instance_then_stops() -> None:
    """With --metrics: every service's /metrics URL printed, and served."""
    up = start_up("--pd", "--metrics")
    urls = dict(re.findall(r"Prometheus \(([\w-]+)\) at (http://\S+/metrics)",
                           "\n".join(up.printed)))
    assert set(urls) == set(up.services)
    for name, url in urls.items():
        with urllib.request.urlopen(url, timeout=10) as reply:
            prefix = "kvstash_" + name.rpartition("-")[2]
            assert prefix in reply.read().decode(), name

    async def call() -> tuple[list[int], int]:
        async with Client(up.services["scheduler"][0]) as client:
            result = await client.complete([1, 2, 3], max_tokens=4, ignore_eos=True)
        async with Client(up.services["decode-scheduler"][0]) as decode:
            return result.token_ids, (await decode.stats()).num_reservations_accepted

    tokens, reserved = asyncio.run(call())
    assert len(tokens) == 4 and reserved == 1
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(30) == 0
    assert not wait_gone(up.pids)
    shutil.rmtree(up.log_dir)


def test_up_gateway_serves_openai_http_over_its_instances_and_its_death_stops_all() -> None:
    up = start_up("--instances", "2", "--gateway", "--gateway-port", "0")
    url = f"http://{up.services['gateway'][0]}"
    body = {"model": "tiny", "prompt": "hello kv", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    reply = request_json(f"{url}/v1/completions", body)
    assert reply["usage"]["completion_tokens"] == 6
    # smg's own metrics: printed, on --listen's host, serving.
    metrics = next(line.split(" at ")[1] for line in up.printed
                   if line.startswith("Prometheus (smg) at "))
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", metrics)
    with urllib.request.urlopen(metrics, timeout=10) as scraped:
        assert b"# TYPE" in scraped.read()
    # smg.log is plain text: smg colours it, the launcher strips the codes.
    log = (up.log_dir / "smg.log").read_bytes()
    assert b"INFO" in log and b"\x1b[" not in log

    async def served() -> list[int]:
        counts = []
        for name in ("scheduler", "instance2-scheduler"):
            async with Client(up.services[name][0]) as client:
                counts.append((await client.stats()).num_finished)
        return counts

    assert sum(asyncio.run(served())) == 1  # one instance served it
    os.kill(up.services["gateway"][1], signal.SIGKILL)
    assert up.process.wait(30) == 1
    assert up.process.stderr is not None
    assert f"gateway exited with code -9; stopping the others. Its log: {up.log_dir}/smg.log" \
        in up.process.stderr.read()
    assert not wait_gone(up.pids)
    shutil.rmtree(up.log_dir)


@pytest.mark.parametrize("extra", [(), ("--gateway", "--instances", "2")])
def test_demo_checks_pressured_outputs_against_replays(extra: tuple[str, ...]) -> None:
    """The demo's pool is too small for its requests, yet every output
    equals its replay alone and nothing is left in the cache. (Whether a
    run preempts depends on timing: test_preemption.py and test_gateway.py
    force preemptions.)"""
    done = subprocess.run(
        [sys.executable, "-m", "kvstash.launch.cli", "demo", "--requests", "12",
         "--max-tokens", "48", "--num-blocks", "24", *extra],
        check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    table = dict(re.findall(r"^(\w[\w /()]*?)\s{2,}(.+)$", done.stdout, re.MULTILINE))
    assert table["outputs equal to unpressured run" + (" (text)" if extra else "")] == "12/12"
    assert re.fullmatch(r"\d+ / \d+", table["preemptions offload / recompute"])
    assert table["snapshots left in cache"] == "0"
    if extra:
        per_instance = [int(n) for n in table["requests per instance"].split(" / ")]
        assert len(per_instance) == 2 and sum(per_instance) == 12


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_demo_stopped_while_running_leaves_nothing_behind(sig: signal.Signals) -> None:
    """A demo stopped mid-run (`timeout`, a service manager, Ctrl-C) stops
    its services and removes their data directory, in one line."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvstash.launch.cli", "demo", "--requests", "64",
         "--max-tokens", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert demo.stdout is not None and demo.stderr is not None
    for line in demo.stdout:  # the stack is up and the requests are going out
        if line.startswith("-- 64 concurrent requests"):
            break
    children = child_pids(demo.pid)
    assert len(children) == 3, children
    cache_args = Path(f"/proc/{children[0]}/cmdline").read_text().split("\0")
    data_dir = Path(cache_args[cache_args.index("--disk-dir") + 1]).parent
    assert data_dir.is_dir()

    demo.send_signal(sig)
    assert demo.wait(30) == 1
    assert not wait_gone(children)
    assert not data_dir.exists()
    assert demo.stderr.read().splitlines() == [f"stopped ({sig.name})"]




def test_up_stopped_while_starting_leaves_nothing_behind(tmp_path: Path) -> None:
    up = subprocess.Popen(
        [sys.executable, "-m", "kvstash.launch.cli", "up", "--listen", "127.0.0.1:0",
         "--log-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    # The cache is up and the worker starting: a stop now lands in the wait
    # for the worker's ready line.
    deadline = time.monotonic() + 60
    while len(children := child_pids(up.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(children) == 2, children
    up.send_signal(signal.SIGTERM)
    up.wait(30)
    # Gone already: stopped and reaped before `up` exited, not left to die
    # of a broken pipe whenever the worker finishes loading.
    assert not [pid for pid in children if _alive(pid)]


def test_up_names_a_dead_service_and_keeps_its_log() -> None:
    up = start_up()
    os.kill(up.services["worker"][1], signal.SIGKILL)
    assert up.process.wait(30) == 1
    assert up.process.stderr is not None
    err = up.process.stderr.read()
    assert f"worker exited with code -9; stopping the others. Its log: {up.log_dir}" in err
    assert (up.log_dir / "worker.log").exists()
    assert (up.log_dir / "scheduler.log").exists()
    assert not wait_gone(up.pids)
    shutil.rmtree(up.log_dir)


def test_console_span_exporter_output_reaches_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    with running_stack(StackConfig(num_blocks=32), tmp_path) as stack:

        async def call() -> None:
            async with Client(stack.address) as client:
                await client.complete([1, 2, 3], max_tokens=4, ignore_eos=True)

        asyncio.run(call())
    # Stopping flushed the exporter; the stdout it wrote to went to the log.
    log = (tmp_path / "scheduler.log").read_text()
    assert '"name": "/kvstash.v1.Scheduler/Generate"' in log
    assert '"name": "kvstash.decode"' in log


def test_every_service_runs_alone_with_help() -> None:
    for module in ("scheduler_svc", "cache_svc", "gpu_worker", "kvstash.launch.cli"):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                             text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        assert "--listen" in out.stdout or module == "kvstash.launch.cli"
