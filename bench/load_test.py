"""Load test: N concurrent streaming clients against a real stack on loopback.

    python -m bench.load_test                          # 32 clients, 30 s per phase
    python -m bench.load_test --clients 8 --duration 10 --max-num-waiting 8

Starts cache, worker (the tiny CPU model by default) and scheduler, then runs
two phases on that one stack, each for a fixed duration:

    phase   clients                                 expected
    steady  --clients <= max_num_waiting            every request completes
    flood   > max_num_seqs + max_num_waiting        RESOURCE_EXHAUSTED, no other code

and finally one ordinary request, which must complete: the stack still serves.
The steady phase cannot be refused: each client has at most one request in
flight, so the waiting queue never holds more than `clients` requests.

Each client has its own channel and loops: one streaming Generate (a random
token-id prompt, greedy, ignore_eos, fixed max_tokens), its outcome recorded,
the next; after an error it backs off `retry_backoff_s`, as a well-behaved
client retries RESOURCE_EXHAUSTED. When the duration ends, clients start
nothing new and the requests in flight are let finish (each client is
cancelled after `drain_timeout_s` more and counted as ABANDONED), so a phase's
wall time runs to its last completion and requests/s = completed / wall.

TTFT: from the call to the first delta with tokens, as the client sees it.
TPOT: (last delta - first delta) / (tokens - 1). Peak RSS per phase is the
highest VmRSS sampled every 50 ms; the lifetime peak is each process's VmHWM
(its start included), with the share that is shared memory (the cache's
arena, mapped populated, counts whole). CPU % per phase: each process's CPU
time over the phase's wall time (100 = one core).

The clients run in this process, on the same cores as the three services:
on a small machine they take a share of its CPU (the CPU % line says how
much), and timings are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc

from kvstash import errors
from kvstash.client import Client
from kvstash.common import rpc_errors
from kvstash.common.units import MIB
from kvstash.launch.stack import Stack, StackConfig, running_stack

OK = "OK"
ABANDONED = "ABANDONED"  # still in flight when the drain timeout ran out
BAD_FINISH = "BAD_FINISH"  # ended without error, but not with max_tokens tokens
KIB = 1024
CLIENTS = "clients"  # this process, where the load generator runs
TOKEN_ID_RANGE = 256  # valid for the tiny model and any real vocabulary


@dataclass(frozen=True, slots=True)
class LoadConfig:
    num_clients: int = 32  # steady phase; at most max_num_waiting
    num_flood_clients: int = 0  # 0: twice max_num_seqs + max_num_waiting
    duration_s: float = 30.0  # per phase, before the drain
    max_tokens: int = 32
    min_prompt_tokens: int = 16
    max_prompt_tokens: int = 64
    max_num_seqs: int = 16  # the scheduler's running set
    max_num_waiting: int = 32  # the scheduler's queue limit
    num_blocks: int = 512
    model: str = "tiny"
    cache_memory_budget: str = "1GiB"
    retry_backoff_s: float = 0.1
    request_timeout_s: float = 120.0
    drain_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_clients", "duration_s", "max_tokens", "min_prompt_tokens",
                     "max_num_seqs", "max_num_waiting", "request_timeout_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_prompt_tokens < self.min_prompt_tokens:
            raise ValueError(f"max_prompt_tokens {self.max_prompt_tokens} < "
                             f"min_prompt_tokens {self.min_prompt_tokens}")
        if self.num_clients > self.max_num_waiting:
            raise ValueError(f"the steady phase must stay below the queue limit: "
                             f"{self.num_clients} clients > max_num_waiting {self.max_num_waiting}")
        limit = self.max_num_seqs + self.max_num_waiting
        if self.num_flood_clients and self.num_flood_clients <= limit:
            raise ValueError(f"a flood needs more than max_num_seqs + max_num_waiting = {limit} "
                             f"clients, got {self.num_flood_clients}")

    @property
    def flood_clients(self) -> int:
        return self.num_flood_clients or 2 * (self.max_num_seqs + self.max_num_waiting)

    def stack_config(self) -> StackConfig:
        return StackConfig(
            model=self.model, num_blocks=self.num_blocks, max_num_seqs=self.max_num_seqs,
            cache_memory_budget=self.cache_memory_budget,
            scheduler_args=("--max-num-waiting", str(self.max_num_waiting)),
        )


class Percentiles(NamedTuple):
    p50: float
    p99: float


@dataclass(frozen=True, slots=True)
class Sample:
    """One request's outcome: OK, a gRPC status code name, ABANDONED or BAD_FINISH."""

    outcome: str
    num_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None  # None with fewer than two tokens
    message: str = ""


@dataclass(frozen=True, slots=True)
class PhaseReport:
    name: str
    num_clients: int
    duration_s: float  # as configured
    wall_s: float  # from the start to the last request in flight ending
    num_completed: int
    num_tokens: int  # in completed requests
    errors: dict[str, int]  # outcome -> count, every outcome but OK
    error_examples: dict[str, str]  # outcome -> the first message seen
    ttft_ms: Percentiles | None  # of completed requests; None if there were none
    tpot_ms: Percentiles | None
    peak_rss_mib: dict[str, float]  # service -> highest VmRSS sampled in the phase
    # service or CLIENTS -> CPU time over wall time in the phase, % (100 = one core)
    cpu_percent: dict[str, float]

    @property
    def requests_per_s(self) -> float:
        return self.num_completed / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s


@dataclass(frozen=True, slots=True)
class LoadReport:
    config: LoadConfig
    steady: PhaseReport
    flood: PhaseReport
    probe: Sample  # one ordinary request after the flood
    lifetime_peak_rss_mib: dict[str, float]  # service -> VmHWM at the end
    shared_rss_mib: dict[str, float]  # service -> RssShmem at the end
    exited: list[str] = field(default_factory=list)  # services not running at the end

    def problems(self) -> list[str]:
        """What did not go as expected; empty when everything did."""
        found = []
        if self.steady.errors:
            found.append(f"steady phase errors: {self.steady.errors}")
        if self.steady.num_completed == 0:
            found.append("steady phase completed no request")
        if self.flood.errors.get("RESOURCE_EXHAUSTED", 0) == 0:
            found.append("the flood got no RESOURCE_EXHAUSTED")
        other = {k: v for k, v in self.flood.errors.items() if k != "RESOURCE_EXHAUSTED"}
        if other:
            found.append(f"flood errors other than RESOURCE_EXHAUSTED: {other}")
        if self.probe.outcome != OK:
            found.append(f"request after the flood: {self.probe.outcome} {self.probe.message}")
        if self.exited:
            found.append(f"services exited: {self.exited}")
        return found


def status_name(exc: errors.KvstashError) -> str:
    """The gRPC status a client error came from. The client names the original
    code in the message ("generate: DEADLINE_EXCEEDED: ...") where its error
    class maps back to another one (DEADLINE_EXCEEDED, INTERNAL -> Unavailable)."""
    parts = str(exc).split(": ", 2)
    if len(parts) >= 2 and parts[1] in grpc.StatusCode.__members__:
        return parts[1]
    return rpc_errors.status_for(exc).name


def percentiles(values: list[float]) -> Percentiles | None:
    if not values:
        return None
    ordered = sorted(values)

    def rank(q: float) -> float:  # nearest rank
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return Percentiles(rank(0.50), rank(0.99))


def read_status_kib(pid: int, key: str) -> int | None:
    """A `key:  123 kB` line of /proc/PID/status, or None (gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each process, and of this one as CLIENTS."""
    found = {CLIENTS: time.process_time()}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as stat:  # utime, stime: fields 14, 15
                fields = stat.read().rsplit(")", 1)[1].split()
            found[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            continue
    return found


class RssSampler:
    """Reads VmRSS of each process every `interval_s` on a thread; `take_peaks`
    returns the highest seen since the previous take and starts over."""

    def __init__(self, pids: Mapping[str, int], interval_s: float = 0.05) -> None:
        self._pids = dict(pids)
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._peaks_kib: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        for name, pid in self._pids.items():
            kib = read_status_kib(pid, "VmRSS")
            if kib is not None:
                with self._lock:
                    self._peaks_kib[name] = max(kib, self._peaks_kib.get(name, 0))

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def take_peaks(self) -> dict[str, float]:
        self._sample()  # a phase shorter than one interval still gets a reading
        with self._lock:
            peaks, self._peaks_kib = self._peaks_kib, {}
        return {name: kib * KIB / MIB for name, kib in peaks.items()}


def make_prompt(rng: random.Random, config: LoadConfig) -> list[int]:
    length = rng.randint(config.min_prompt_tokens, config.max_prompt_tokens)
    return [rng.randrange(TOKEN_ID_RANGE) for _ in range(length)]


async def one_request(client: Client, prompt: list[int], config: LoadConfig) -> Sample:
    start = time.perf_counter()
    first = last = start
    num_tokens = 0
    finish_reason = None
    try:
        async for delta in client.generate(prompt, max_tokens=config.max_tokens, ignore_eos=True,
                                           timeout_s=config.request_timeout_s):
            if delta.token_ids:
                last = time.perf_counter()
                if num_tokens == 0:
                    first = last
                num_tokens += len(delta.token_ids)
            finish_reason = delta.finish_reason or finish_reason
    except errors.KvstashError as exc:
        return Sample(status_name(exc), message=str(exc))
    if finish_reason != "length" or num_tokens != config.max_tokens:
        return Sample(BAD_FINISH, num_tokens, message=f"finish_reason {finish_reason}, "
                      f"{num_tokens} of {config.max_tokens} tokens")
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else None
    return Sample(OK, num_tokens, first - start, tpot)


async def client_loop(index: int, address: str, deadline: float, config: LoadConfig,
                      samples: list[Sample]) -> None:
    rng = random.Random(config.seed * 1_000_003 + index)
    async with Client(address) as client:
        while time.perf_counter() < deadline:
            sample = await one_request(client, make_prompt(rng, config), config)
            samples.append(sample)
            if sample.outcome != OK:
                left = deadline - time.perf_counter()
                await asyncio.sleep(max(0.0, min(config.retry_backoff_s, left)))


async def run_phase(name: str, num_clients: int, address: str, config: LoadConfig,
                    pids: Mapping[str, int], sampler: RssSampler) -> PhaseReport:
    samples: list[Sample] = []
    sampler.take_peaks()  # forget what came before this phase
    cpu_before = cpu_seconds(pids)
    start = time.perf_counter()
    deadline = start + config.duration_s
    tasks = [asyncio.create_task(client_loop(i, address, deadline, config, samples))
             for i in range(num_clients)]
    _, pending = await asyncio.wait(tasks, timeout=config.duration_s + config.drain_timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.perf_counter() - start
    cpu = {name: (secs - cpu_before[name]) / wall * 100
           for name, secs in cpu_seconds(pids).items() if name in cpu_before}
    for task in tasks:  # an exception other than a status is a bug here: surface it
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            raise exc
    samples += [Sample(ABANDONED, message="in flight at the drain timeout")] * len(pending)
    done = [s for s in samples if s.outcome == OK]
    examples: dict[str, str] = {}
    for sample in samples:
        if sample.outcome != OK:
            examples.setdefault(sample.outcome, sample.message)
    return PhaseReport(
        name, num_clients, config.duration_s, wall, len(done), sum(s.num_tokens for s in done),
        dict(Counter(s.outcome for s in samples if s.outcome != OK)), examples,
        percentiles([s.ttft_s * 1000 for s in done if s.ttft_s is not None]),
        percentiles([s.tpot_s * 1000 for s in done if s.tpot_s is not None]),
        sampler.take_peaks(), cpu,
    )


async def measure(stack: Stack, config: LoadConfig) -> LoadReport:
    """Both phases and the probe on a running stack."""
    pids = {s.name: s.process.pid for s in stack.services}
    with RssSampler(pids) as sampler:
        steady = await run_phase("steady", config.num_clients, stack.address, config, pids,
                                 sampler)
        flood = await run_phase("flood", config.flood_clients, stack.address, config, pids,
                                sampler)
    async with Client(stack.address) as client:
        probe = await one_request(client, make_prompt(random.Random(config.seed), config), config)

    def mib(key: str) -> dict[str, float]:
        found = {name: read_status_kib(pid, key) for name, pid in pids.items()}
        return {name: kib * KIB / MIB for name, kib in found.items() if kib is not None}

    exited = [s.name for s in stack.services if s.process.poll() is not None]
    return LoadReport(config, steady, flood, probe, mib("VmHWM"), mib("RssShmem"), exited)


def run_load(config: LoadConfig) -> LoadReport:
    """Starts a stack on loopback, measures, stops it."""
    with running_stack(config.stack_config()) as stack:
        return asyncio.run(measure(stack, config))


def format_report(report: LoadReport) -> str:
    services = ("scheduler", "worker", "cache")

    def pct(p: Percentiles | None) -> str:
        return "-" if p is None else f"{p.p50:.0f} / {p.p99:.0f}"

    def rss(values: Mapping[str, float], names: tuple[str, ...] = services) -> str:
        return " / ".join(f"{values[s]:.0f}" if s in values else "-" for s in names)

    header = ("phase", "clients", "wall s", "completed", "req/s", "tokens/s",
              "TTFT p50/p99 ms", "TPOT p50/p99 ms", "peak RSS MiB sched/worker/cache", "errors")
    rows = [header] + [
        (p.name, str(p.num_clients), f"{p.wall_s:.1f}", str(p.num_completed),
         f"{p.requests_per_s:.1f}", f"{p.tokens_per_s:.0f}", pct(p.ttft_ms), pct(p.tpot_ms),
         rss(p.peak_rss_mib),
         ", ".join(f"{k} {v}" for k, v in sorted(p.errors.items())) or "0")
        for p in (report.steady, report.flood)
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    c = report.config
    lines += [
        "",
        f"max_tokens {c.max_tokens}, prompts {c.min_prompt_tokens}-{c.max_prompt_tokens} tokens, "
        f"max_num_seqs {c.max_num_seqs}, max_num_waiting {c.max_num_waiting}, "
        f"{c.duration_s:g} s per phase, then in-flight requests drained",
        f"lifetime peak RSS (VmHWM) MiB sched/worker/cache: {rss(report.lifetime_peak_rss_mib)}"
        f"  (shared memory: {rss(report.shared_rss_mib)})",
        f"request after the flood: {report.probe.outcome} {report.probe.message}".rstrip(),
    ]
    lines += [f"{p.name} CPU % sched/worker/cache/clients (100 = one core): "
              f"{rss(p.cpu_percent, (*services, CLIENTS))}" for p in (report.steady, report.flood)]
    for phase in (report.steady, report.flood):
        lines += [f"{phase.name} {code}: {msg}" for code, msg in phase.error_examples.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    d = LoadConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=d.num_clients,
                   help="steady-phase clients, at most --max-num-waiting")
    p.add_argument("--flood-clients", type=int, default=d.num_flood_clients,
                   help="flood-phase clients; 0 = 2 * (max-num-seqs + max-num-waiting)")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds per phase")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--min-prompt-tokens", type=int, default=d.min_prompt_tokens)
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-waiting", type=int, default=d.max_num_waiting)
    p.add_argument("--num-blocks", type=int, default=d.num_blocks)
    p.add_argument("--model", default=d.model)
    p.add_argument("--cache-memory-budget", default=d.cache_memory_budget)
    p.add_argument("--retry-backoff", type=float, default=d.retry_backoff_s,
                   help="seconds a client waits after an error")
    p.add_argument("--seed", type=int, default=d.seed)
    args = p.parse_args(argv)
    try:
        config = LoadConfig(
            num_clients=args.clients, num_flood_clients=args.flood_clients,
            duration_s=args.duration, max_tokens=args.max_tokens,
            min_prompt_tokens=args.min_prompt_tokens, max_prompt_tokens=args.max_prompt_tokens,
            max_num_seqs=args.max_num_seqs, max_num_waiting=args.max_num_waiting,
            num_blocks=args.num_blocks, model=args.model,
            cache_memory_budget=args.cache_memory_budget, retry_backoff_s=args.retry_backoff,
            seed=args.seed,
        )
    except ValueError as exc:
        p.error(str(exc))
    print(f"load test: {config.num_clients} then {config.flood_clients} streaming clients, "
          f"{config.duration_s:g} s each, on a {config.model} stack ...", flush=True)
    report = run_load(config)
    print(format_report(report))
    for problem in report.problems():
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
