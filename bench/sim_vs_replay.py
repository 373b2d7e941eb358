"""The simulator against the real stack: the same trace slice replayed through
real processes (bench.replay) and simulated (kvstash sim) with a profile
calibrated on this machine, side by side, with the error of each figure.
Real figures are the median of --repeat runs (their min-max beside it): on a
shared host one real run's TTFT can move by 2x from the next.

    python -m bench.sim_vs_replay --trace ../shared/traces/mooncake_conversation.jsonl \\
        --count 40 --length-scale 0.0625 --rates 0.5,1 --policies recompute,auto \\
        --model llama-small --num-blocks 160

The profile must describe the model and the worker's threads the stack runs
(the shipped CPU profile: llama-small float32 and what `kvstash up` gives one
worker here); the scheduler settings are the same on both sides. `--pd`: a
prefill and a decode instance on each side (P/D through the cache; the
figures are the prefill instance's, which streams every token). Error =
simulated / real - 1, of the medians.

The simulation runs --sim-runs times, each arrival after the first run
later by up to --jitter (the lag a real client adds when it sends, which
also decides which of a burst's requests the scheduler takes first): on a
short slice which request a long prefill step lands beside decides the
latency percentiles, so that order moves TTFT p50 by up to 2x, in the real
runs as in the simulated ones, and one exact run is one draw of them.

Each real run's (prefill) scheduler records its decisions (`--record-
decisions`, which also keeps its prefix tier off: the simulation has none),
and the record is replayed against the profile: `step s/profile` is the
run's steps over what the profile gives the same steps (each step's turn of
the engine's loop, from its schedule() to the next: what a profile fitted
with `kvstash calibrate --from-record` models). Above 1 the
host ran those steps slower than the profile says, and the simulation's
latencies come out low by about as much.

The record also says when each request reached the scheduler, so each real
run is simulated once more as it was served (`paired`): every request
arriving when that run's scheduler added it, in that order, and timed, as
the client timed it, from when it was due. What is left between a real run
and its paired simulation is the timing model's error alone, with no draw
of the arrival order in it. (The client's due times and the scheduler's
clock are both CLOCK_MONOTONIC: time.perf_counter and time.monotonic.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.offload_vs_recompute import MAX_MODEL_LEN
from bench.replay.runs import POLICIES, RunResult, run_policy
from bench.worker_bench import write_checkpoint
from kvstash.common.units import parse_bytes
from kvstash.launch.stack import StackConfig
from kvstash.sim.cache import SimCache
from kvstash.sim.cluster import Cluster, SimResult, counters_of, instance_configs
from kvstash.sim.pd import PdCluster, pd_configs
from kvstash.sim.profile import DEFAULT_PROFILE, CostProfile, read_profile
from kvstash.sim.replay import read_record, replay
from kvstash.workload import flags
from kvstash.workload.metrics import Slo, Summary, strict, summarize
from kvstash.workload.prompts import build_prompts
from kvstash.workload.trace import Trace, jittered_runs

Figures = tuple[float, ...]  # FIGURES' values
FIGURES = ("req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "preemptions",
           "hand-offs", "step s/profile")


def figures(summary: Summary, counters: dict[str, int], step_ratio: float = 1.0
            ) -> Figures:
    """FIGURES; counters are the (prefill) instance's: its preemptions and
    hand-offs (a decode instance's preemptions are not among them).
    `step_ratio`: the run's step turns over the profile's for the same
    steps (a simulation's are the profile's: 1)."""
    preempted = counters["num_preemptions_offload"] + counters["num_preemptions_recompute"]
    return (summary.requests_per_s, summary.output_tokens_per_s, summary.ttft_s["p50"],
            summary.ttft_s["p99"], summary.tpot_s["p50"], float(preempted),
            float(counters["num_handoffs"]), step_ratio)


@dataclasses.dataclass(frozen=True, slots=True)
class RealRun:
    run: RunResult
    step_ratio: float  # its step turns over the profile's for the same steps
    served: Trace  # the slice as its scheduler received it (as_served)
    due_s: list[float]  # each of served's requests' arrival in the slice


def real_run(base: StackConfig, policy: str, trace: Trace, prompts: list[list[int]],
             profile: CostProfile, record: Path) -> RealRun:
    """One run through a real stack, its (prefill) scheduler recording its
    decisions; its steps' turns (schedule() to schedule()) over the
    profile's for the same steps, summed (how much slower than the profile
    the host ran it: what the simulation cannot know); and the arrivals its
    scheduler saw."""
    flag = ("--record-decisions", str(record))
    base = (dataclasses.replace(base, prefill_scheduler_args=(*base.prefill_scheduler_args,
                                                              *flag)) if base.pd
            else dataclasses.replace(base, scheduler_args=(*base.scheduler_args, *flag)))
    run = run_policy(base, policy, trace, prompts)
    lines = read_record(record)
    done = replay(lines)
    if done.mismatch is not None:
        raise SystemExit(f"the real run's record does not replay: {done.mismatch}")
    turns = list(zip(done.steps, done.turns, strict=False))
    predicted = sum(profile.step.of_features(features) for (features, _), _ in turns)
    return RealRun(run, sum(turn for _, turn in turns) / predicted,
                   *as_served(trace, prompts, run, lines))


def as_served(trace: Trace, prompts: list[list[int]], run: RunResult,
              lines: list[dict[str, Any]]) -> tuple[Trace, list[float]]:
    """The slice as the run's scheduler received it: each request arriving
    (from the slice's start, as the client kept it) when the record says the
    core added it, in that order (one the stack refused keeps its own
    arrival); and each one's arrival in the slice, to time it from. A
    request is known by its prompt; the run's warm-up, added before the
    slice started, is none of them."""
    start = run.records[0].sent_s - trace.requests[0].arrival_s
    waiting: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        waiting.setdefault(tuple(prompt), []).append(i)
    added: dict[int, float] = {}
    for line in lines:
        if line["op"] == "add" and line["t"] >= start and (
                same := waiting.get(tuple(line["prompt"]))):
            i = same.pop(0)
            added[i] = line["t"] - start
            if added[i] < trace.requests[i].arrival_s - 0.001:
                raise SystemExit(f"request {i} reached the scheduler before it was due: "
                                 "the client's and the scheduler's clocks differ")
    order = sorted((added.get(i, r.arrival_s), i) for i, r in enumerate(trace.requests))
    served = Trace(tuple(dataclasses.replace(trace.requests[i], arrival_s=t) for t, i in order),
                   trace.block_tokens)
    return served, [trace.requests[i].arrival_s for _, i in order]


def simulate(args: argparse.Namespace, profile: CostProfile, policy: str, trace: Trace
             ) -> tuple[SimResult, dict[str, int]]:
    """The stack's settings (StackConfig's block size) in simulated instances:
    one mixed, or with --pd one prefill and one decode; and the counters of
    the instance the real run reads its own from (the prefill one)."""
    settings = dict(num_blocks=args.num_blocks, block_size=StackConfig().block_size,
                    max_model_len=MAX_MODEL_LEN[args.model], max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    bytes_per_block=profile.bytes_per_block)
    cache = SimCache(parse_bytes(args.cache_memory_budget), 0)
    cluster = (PdCluster(*pd_configs(policy, 1, 1, **settings), profile, cache) if args.pd
               else Cluster(instance_configs(policy, 1, **settings), profile, cache))
    return cluster.run(trace), counters_of(cluster.front[0].core)


def paired(args: argparse.Namespace, profile: CostProfile, policy: str, slo: Slo,
           real: RealRun) -> Figures:
    """The figures of one simulation of the real run as it was served, each
    request timed from when it was due."""
    sim, counters = simulate(args, profile, policy, real.served)
    for record, due in zip(sim.records, real.due_s, strict=True):
        record.sent_s = due
    return figures(summarize(sim.records, slo), counters)


def simulated(args: argparse.Namespace, profile: CostProfile, policy: str, slo: Slo,
              trace: Trace) -> list[Figures]:
    """The figures of --sim-runs simulations: the trace as it is, then
    jittered copies (seeds 1, 2, ...)."""
    runs = []
    for run in jittered_runs(trace, args.sim_runs, args.jitter):
        sim, counters = simulate(args, profile, policy, run)
        runs.append(figures(summarize(sim.records, slo), counters))
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim_vs_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_flags(p)
    p.add_argument("--policies", default="recompute,auto")
    p.add_argument("--model", choices=sorted(MAX_MODEL_LEN), default="llama-small")
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    p.add_argument("--num-blocks", type=int, default=160)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--cache-memory-budget", default="1GiB")
    p.add_argument("--slo-ttft", type=float, default=5.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--repeat", type=int, default=1, help="real runs per point (median)")
    p.add_argument("--sim-runs", type=int, default=15,
                   help="simulations per point: the exact arrivals, then jittered copies")
    p.add_argument("--jitter", type=float, default=0.002,
                   help="seconds each arrival may be late in the jittered simulations")
    p.add_argument("--json", type=Path, help="also write every run's figures here")
    p.add_argument("--pd", action="store_true",
                   help="a prefill and a decode instance (P/D), not one mixed instance")
    args = p.parse_args(argv)
    flags.check_flags(p, args)
    if args.repeat < 1 or args.sim_runs < 1:
        p.error("--repeat and --sim-runs must be >= 1")
    if args.jitter < 0:
        p.error(f"--jitter must be >= 0, got {args.jitter}")
    policies = args.policies.split(",")
    if unknown := [x for x in policies if x not in POLICIES]:
        p.error(f"unknown policies {unknown}")
    try:
        slo = Slo(args.slo_ttft, args.slo_tpot)
        raw = flags.load_slice(args)
        fitted = flags.fit_slices(args, raw, flags.max_context(
            args, MAX_MODEL_LEN[args.model], args.num_blocks * StackConfig().block_size))
        profile = read_profile(args.profile)
    except (ValueError, OSError) as exc:  # TraceError and ProfileError are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Per (policy, rate): the real runs', the simulations' and the paired ones' figures.
    rows: list[tuple[str, float, list[Figures], list[Figures], list[Figures]]] = []
    with tempfile.TemporaryDirectory(prefix="kvstash-simcheck-") as workdir:
        model = args.model
        if model != "tiny":
            model = str(Path(workdir) / model)
            write_checkpoint(Path(model), args.model, "float32")
        base = StackConfig(model=model, dtype="auto" if args.model == "tiny" else "float32",
                           num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           cache_memory_budget=args.cache_memory_budget, pd=args.pd)
        for trace, _ in fitted:
            prompts = build_prompts(trace, args.seed)
            for policy in policies:
                reals = [real_run(base, policy, trace, prompts, profile,
                                  Path(workdir) / f"record-{n}.jsonl")
                         for n in range(args.repeat)]
                rows.append((policy, trace.rate,
                             [figures(summarize(r.run.records, slo), r.run.counters,
                                      r.step_ratio) for r in reals],
                             simulated(args, profile, policy, slo, trace),
                             [paired(args, profile, policy, slo, r) for r in reals]))
                print(f"{policy} @ {trace.rate:.3g}/s done", file=sys.stderr, flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(strict(
            [{"policy": policy, "rate": rate, "figures": FIGURES, "real": real, "sim": sim,
              "paired": pairs} for policy, rate, real, sim, pairs in rows]), indent=1,
            allow_nan=False))
    print(f"{'policy':<12} {'rate':>5} {'figure':<14} {'real':>9} {'real min-max':>19} "
          f"{'sim':>9} {'sim min-max':>19} {'error':>7} {'paired':>9} {'paired err':>10}")
    for policy, rate, real_runs, sim_runs, pairs in rows:
        for i, name in enumerate(FIGURES):
            values = [run[i] for run in real_runs]
            sims = [run[i] for run in sim_runs]
            real, sim = statistics.median(values), statistics.median(sims)
            error = f"{sim / real - 1:+.0%}" if real else "n/a"
            # Each real run against its own paired simulation, then the median.
            pair = statistics.median(run[i] for run in pairs)
            errors = [p[i] / r[i] - 1 for p, r in zip(pairs, real_runs, strict=True) if r[i]]
            print(f"{policy:<12} {rate:>5.3g} {name:<14} {real:>9.3f} "
                  f"{min(values):>9.3f}-{max(values):<9.3f} {sim:>9.3f} "
                  f"{min(sims):>9.3f}-{max(sims):<9.3f} {error:>7} {pair:>9.3f} "
                  f"{f'{statistics.median(errors):+.0%}' if errors else 'n/a':>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
