"""The stack beside a CPU hog: the workers' default torch threads against the
old behaviour (torch's default, one thread per core in every worker), side by
side in one run.

    python -m bench.cpu_contention                       # 2 hogs, 2 instances
    python -m bench.cpu_contention --modes default,all-cores,1 --hogs 2 --rate 2

Starts --hogs busy loops (`python -c 'while True: pass'`) that spin for the
whole run, then for each mode in turn (a mode is what the workers are given):

    default     no --worker-threads: the usable CPUs less one, shared among the workers
    all-cores   --worker-threads os.cpu_count(): what torch took before
    N           --worker-threads N

1. A fixed load on a stack of --instances instances (`kvstash up
   --instances I`): --requests streaming greedy requests (random token-id
   prompts of --prompt-tokens, --max-tokens each) started at a constant
   --rate, round-robin over the instances. Counted: the requests completed
   within --deadline seconds of the first one's start, their client-side TTFT
   p50, and the schedulers' steps in that window. What is still running at the
   deadline is cancelled.
2. On the same stack, one prompt of --long-prompt tokens alone: its TTFT, or
   "> --long-timeout".
3. `kvstash demo --instances <--demo-instances>` (its own stack) as a
   subprocess: the wall time and throughput of its pressured phase, and the
   whole run's seconds (start-up and replays included), or "> --demo-timeout"
   when it does not finish (it is then stopped with its services: SIGINT,
   then SIGTERM and SIGKILL to its process group).

The hogs and the load's clients share the machine's cores with the services:
the figures say how the stack fares on a busy host, not its best.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstash import errors
from kvstash.client import Client
from kvstash.launch.stack import Stack, StackConfig, running_stack, worker_threads

BYTE_TOKENS = 256  # the tiny model's byte ids; 256 and 257 are BOS and EOS


@dataclass(slots=True)
class ModeResult:
    mode: str
    threads: int  # torch threads of each worker
    completed: int  # of the fixed load, within the deadline
    load_ttft_p50_ms: float | None
    steps: int  # the schedulers', during the fixed load
    long_ttft_s: float | None  # None: past --long-timeout
    demo_wall_s: float | None  # the demo's pressured phase; None: it did not finish
    demo_tokens_per_s: float | None
    demo_run_s: float | None  # the whole `kvstash demo`: start-up, phase, replays, stop


def mode_threads(mode: str) -> int | None:
    """--worker-threads for a mode (None: the launcher's default)."""
    if mode == "default":
        return None
    if mode == "all-cores":
        return os.cpu_count() or 1
    if mode.isdigit() and int(mode) > 0:
        return int(mode)
    raise ValueError(f"mode must be default, all-cores or a thread count, got {mode!r}")


def prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(BYTE_TOKENS) for _ in range(num_tokens)]


async def first_token_s(client: Client, token_ids: list[int], max_tokens: int) -> float:
    """Streams one request to its end; returns its TTFT as this client saw it."""
    start = time.perf_counter()
    ttft = None
    async for delta in client.generate(token_ids, max_tokens=max_tokens, ignore_eos=True):
        if ttft is None and delta.token_ids:
            ttft = time.perf_counter() - start
    assert ttft is not None, "a finished request with no token"
    return ttft


async def fixed_load(stack: Stack, args: argparse.Namespace) -> tuple[int, float | None, int]:
    """(completed within the deadline, their TTFT p50 in ms, scheduler steps)."""
    rng = random.Random(0)
    clients = [Client(address) for address in stack.addresses]
    steps_before = sum([(await c.stats()).num_steps for c in clients])
    ttfts: list[float] = []
    failures: list[str] = []

    async def one(client: Client) -> None:
        try:
            ttfts.append(await first_token_s(client, prompt(rng, args.prompt_tokens),
                                             args.max_tokens))
        except errors.KvstashError as exc:
            failures.append(type(exc).__name__)

    start = time.perf_counter()
    tasks = []
    for i in range(args.requests):
        await asyncio.sleep(max(0.0, start + i / args.rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one(clients[i % len(clients)])))
    left = start + args.deadline - time.perf_counter()
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, left))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    steps = sum([(await c.stats()).num_steps for c in clients]) - steps_before
    for c in clients:
        await c.close()
    if failures:
        print(f"   {len(failures)} requests failed: {sorted(set(failures))}")
    p50 = statistics.median(ttfts) * 1000 if ttfts else None
    return len(ttfts), p50, steps


async def long_prompt(stack: Stack, args: argparse.Namespace) -> float | None:
    async with Client(stack.address) as client:
        try:
            return await asyncio.wait_for(
                first_token_s(client, prompt(random.Random(1), args.long_prompt), 1),
                args.long_timeout)
        except TimeoutError:
            return None


def run_demo(args: argparse.Namespace, threads: int | None
             ) -> tuple[float | None, float | None, float | None]:
    """`kvstash demo` in its own process group: (wall s, tokens/s) of its
    pressured phase and the whole run's seconds, or Nones past --demo-timeout."""
    cmd = [sys.executable, "-m", "kvstash.launch.cli", "demo",
           "--instances", str(args.demo_instances)]
    if threads is not None:
        cmd += ["--worker-threads", str(threads)]
    start = time.perf_counter()
    demo = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = demo.communicate(timeout=args.demo_timeout)
    except subprocess.TimeoutExpired:
        stop_group(demo)
        return None, None, None
    run_s = time.perf_counter() - start
    wall = re.search(r"^wall time\s+([\d.]+) s", out, re.M)
    rate = re.search(r"^throughput\s+([\d.]+) tokens/s", out, re.M)
    if demo.returncode != 0 or wall is None or rate is None:
        raise RuntimeError(f"kvstash demo exited with {demo.returncode}:\n{out[-3000:]}")
    return float(wall[1]), float(rate[1]), run_s


def stop_group(process: subprocess.Popen[str]) -> None:
    """Stops the demo and every service it started: SIGINT (the demo stops
    its services itself), then SIGTERM and SIGKILL to their process group,
    whose id is the demo's pid (start_new_session)."""
    process.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.communicate(timeout=30)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # the group is empty
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and group_alive(process.pid):
            time.sleep(0.2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.communicate(timeout=10)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def run_mode(mode: str, args: argparse.Namespace) -> ModeResult:
    config = StackConfig(instances=args.instances, worker_threads=mode_threads(mode))
    threads, why = worker_threads(config)
    print(f"-- {mode}: {threads} torch threads per worker ({why})", flush=True)
    with running_stack(config) as stack:
        completed, p50, steps = asyncio.run(fixed_load(stack, args))
        print(f"   load: {completed}/{args.requests} completed in {args.deadline:g} s",
              flush=True)
        long_ttft = asyncio.run(long_prompt(stack, args))
    print(f"   {args.long_prompt}-token prompt: TTFT {fmt(long_ttft, '.2f', args.long_timeout)} s",
          flush=True)
    wall, rate, run_s = run_demo(args, config.worker_threads)
    print(f"   demo: {fmt(run_s, '.1f', args.demo_timeout)} s", flush=True)
    return ModeResult(mode, threads, completed, p50, steps, long_ttft, wall, rate, run_s)


def fmt(value: float | None, spec: str, bound: float | None = None) -> str:
    if value is not None:
        return format(value, spec)
    return f">{bound:g}" if bound is not None else "-"


def table(results: list[ModeResult], args: argparse.Namespace) -> str:
    rows = [
        ("torch threads per worker", [str(r.threads) for r in results]),
        (f"load completed (of {args.requests})", [str(r.completed) for r in results]),
        ("load TTFT p50 ms", [fmt(r.load_ttft_p50_ms, ".0f") for r in results]),
        ("scheduler steps during load", [str(r.steps) for r in results]),
        (f"{args.long_prompt}-token prompt TTFT s",
         [fmt(r.long_ttft_s, ".2f", args.long_timeout) for r in results]),
        ("demo wall time s", [fmt(r.demo_wall_s, ".1f") for r in results]),
        ("demo tokens/s", [fmt(r.demo_tokens_per_s, ".0f") for r in results]),
        ("demo whole run s", [fmt(r.demo_run_s, ".1f", args.demo_timeout) for r in results]),
    ]
    width = max(len(name) for name, _ in rows)
    head = " " * width + "".join(f"{r.mode:>12}" for r in results)
    return "\n".join([head, *(f"{name:<{width}}" + "".join(f"{v:>12}" for v in values)
                              for name, values in rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_contention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="default,all-cores",
                   help="comma-separated: default, all-cores or a thread count")
    p.add_argument("--hogs", type=int, default=2, help="busy-loop processes beside the stack")
    p.add_argument("--instances", type=int, default=2, help="of the fixed load's stack")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=2.0, help="requests started per second")
    p.add_argument("--deadline", type=float, default=40.0,
                   help="seconds from the first request's start")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--long-prompt", type=int, default=1000,
                   help="tokens (the tiny model takes at most 1023)")
    p.add_argument("--long-timeout", type=float, default=30.0)
    p.add_argument("--demo-instances", type=int, default=1)
    p.add_argument("--demo-timeout", type=float, default=180.0,
                   help="seconds for the whole demo (start-up and replays included)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    try:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        for mode in modes:
            mode_threads(mode)
    except ValueError as exc:
        p.error(str(exc))
    if args.hogs < 0:
        p.error(f"--hogs must be >= 0, got {args.hogs}")
    for name in ("instances", "requests", "rate", "deadline", "prompt_tokens", "max_tokens",
                 "long_prompt", "long_timeout", "demo_instances", "demo_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.hogs)]
    print(f"{args.hogs} CPU hogs running on {os.cpu_count()} CPUs; {args.requests} requests at "
          f"{args.rate:g}/s over {args.instances} instances, deadline {args.deadline:g} s",
          flush=True)
    try:
        results = [run_mode(mode, args) for mode in modes]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print("\n" + table(results, args))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
