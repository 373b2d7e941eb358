"""`kvstash sim`: a trace through simulated instances, per policy and rate.

    kvstash sim --trace ../shared/traces/mooncake_conversation.jsonl --count 500 \\
        --rates 0.5,1,2 --policies recompute,offload,auto --num-blocks 2048
    kvstash sim --synthetic 2000 --rates 4 --instances 4 --router least-load
    kvstash sim --synthetic 2000 --rates 4 --find instances --target 0.9
    kvstash sim --synthetic 2000 --rates 4 --prefill-instances 2 --decode-instances 2
    kvstash sim --replay decisions.jsonl     # a scheduler's --record-decisions

Each (rate, policy) runs fresh cores on the slice (fitted as the replayer
fits it: kvstash.workload) and prints one row; --json writes every figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstash.common.units import parse_bytes
from kvstash.sim import compiled, find
from kvstash.sim.cache import SimCache
from kvstash.sim.cluster import Cluster, SimResult, instance_configs
from kvstash.sim.pd import PdCluster, pd_configs
from kvstash.sim.profile import COPY_PATHS, DEFAULT_PROFILE, read_profile
from kvstash.sim.replay import read_record, replay
from kvstash.sim.routers import ROUTERS
from kvstash.workload import flags, metrics
from kvstash.workload.metrics import Slo, Summary, median_run, spread, spread_text, summarize
from kvstash.workload.trace import Trace, TraceError, jittered_runs
from scheduler_svc.core.config import POLICIES
from scheduler_svc.core.pd import HANDOFF_WAIT_S

if TYPE_CHECKING:
    from kvstash.workload import plots



def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]
               ) -> argparse.ArgumentParser:
    p = commands.add_parser("sim", help="simulate instances serving a trace, in virtual time",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_flags(p).add_argument(
        "--replay", type=Path, metavar="RECORD",
        help="instead: replay a scheduler's decision record (its --record-decisions) into a "
             "fresh core and check that it decides the same")
    p.add_argument("--core", choices=compiled.CORES, default="auto",
                   help="the scheduler core as its Python sources, or compiled by mypyc "
                        "(built once per version of the sources, 1.2-1.6x faster; needs "
                        "'kvstash[bench]' and a C compiler); auto: compiled where built")
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE,
                   help="cost profile JSON (default: the shipped CPU llama-small profile)")
    p.add_argument("--policies", default="recompute,offload,auto",
                   help=f"comma-separated, of: {', '.join(POLICIES)}")
    p.add_argument("--instances", type=int, default=1, help="mixed instances")
    p.add_argument("--prefill-instances", type=int, default=0,
                   help="P/D instead: this many prefill instances (arrivals are routed "
                        "among them) ...")
    p.add_argument("--decode-instances", type=int, default=0,
                   help="... handing requests off through the cache to this many decode "
                        "instances")
    p.add_argument("--handoff-wait", type=float, default=HANDOFF_WAIT_S,
                   help="P/D: seconds a request waits for a decode instance to reserve "
                        "blocks before its prefill instance decodes it (the scheduler's own)")
    p.add_argument("--router", choices=sorted(ROUTERS), default="round-robin")
    p.add_argument("--transport", choices=[c for c in COPY_PATHS if c != "disk"],
                   default="arena", help="how snapshots reach the cache")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per instance")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--fixed-blocks-per-decode", type=int, default=1)
    p.add_argument("--cache-memory-budget", default="4GiB")
    p.add_argument("--cache-disk-budget", default="0")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="seconds")
    p.add_argument("--runs", type=int, default=1,
                   help="simulations per point: the arrivals as traced, then copies with each "
                        "up to --jitter late; shows the spread of the latency figures (on a "
                        "short trace a millisecond can move a p50 by 2x); --find uses the "
                        "median run")
    p.add_argument("--jitter", type=float, default=0.002,
                   help="seconds an arrival may be late in the jittered runs")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    p.add_argument("--find", choices=sorted(find.DIMENSIONS),
                   help="instead of a table: the least of this resource that keeps SLO "
                        "attainment >= --target, for the first policy at the first rate")
    p.add_argument("--target", type=float, help="with --find: SLO attainment (default 0.9)")
    p.add_argument("--plots", type=Path, metavar="DIR",
                   help="write PNG plots here: latency CDFs and occupancy at the last rate, "
                        "goodput against the rate (needs pip install 'kvstash[bench]')")
    return p


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every instance's scheduler settings."""
    return dict(num_blocks=args.num_blocks, block_size=args.block_size,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                fixed_blocks_per_decode=args.fixed_blocks_per_decode,
                bytes_per_block=args.bytes_per_block)


def simulate(args: argparse.Namespace, policy: str, trace: Trace) -> SimResult:
    cache = SimCache(args.host_bytes, args.disk_bytes)
    cluster: Cluster
    if args.prefill_instances:
        prefill, decode = pd_configs(policy, args.prefill_instances, args.decode_instances,
                                     **settings(args))
        cluster = PdCluster(prefill, decode, args.cost, cache, args.transport, args.router,
                            args.handoff_wait)
    else:
        cluster = Cluster(instance_configs(policy, args.instances, **settings(args)), args.cost,
                          cache, args.transport, args.router)
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is not installed: no bar
        return cluster.run(trace)
    with tqdm(total=len(trace.requests), desc=f"{policy} @ {trace.rate:.3g}/s", unit="req",
              file=sys.stderr, leave=False) as bar:
        return cluster.run(trace, bar.update)


def simulate_runs(args: argparse.Namespace, policy: str, trace: Trace) -> list[SimResult]:
    """--runs simulations: the trace as it is, then jittered copies (seeds 1, 2, ...)."""
    return [simulate(args, policy, run) for run in jittered_runs(trace, args.runs, args.jitter)]


def plotted(policy: str, rate: float, result: SimResult) -> plots.Run:
    from kvstash.workload import plots  # matplotlib: only with --plots

    s = result.samples
    return plots.Run(policy, rate, result.records, [x.t for x in s], [x.pool_used for x in s],
                     [x.host_bytes + x.disk_bytes for x in s])


def write_plots(out: Path, runs: list[plots.Run], slo: Slo, title: str) -> None:
    from kvstash.workload import plots

    out.mkdir(parents=True, exist_ok=True)
    last = [run for run in runs if run.rate == runs[-1].rate]
    plots.latency_cdfs(last, slo, out / "latency_cdf.png", f"{title}, {last[0].rate:.3g} req/s")
    plots.occupancy(last, out / "occupancy.png", f"{title}, {last[0].rate:.3g} req/s")
    if len({run.rate for run in runs}) > 1:
        plots.goodput_by_rate(runs, slo, out / "goodput.png", title)


def row(policy: str, rate: float, summary: Summary, result: SimResult, seconds: float) -> str:
    c = result.counters
    return (f"{policy:<16} {rate:>7.3g} {summary.num_completed:>5}/{summary.num_requests:<5} "
            f"{summary.requests_per_s:>7.3f} {summary.goodput:>7.3f} {summary.attainment:>6.0%} "
            f"{summary.ttft_s['p50']:>8.3f} {summary.ttft_s['p99']:>8.3f} "
            f"{summary.tpot_s['p50']:>8.4f} {c['num_preemptions_offload']:>6} "
            f"{c['num_preemptions_recompute']:>6} {c['num_recomputed_tokens']:>9} "
            f"{seconds:>7.1f}")


def pd_row(result: SimResult) -> str:
    c = result.counters
    # A hand-off fails where its copy does, or no decode instance reserved in
    # time (or one was lost): either way the request finishes where it began.
    return (f"{'':<16} P/D: {c['num_handoffs']} handed off ({c['num_handoff_failures']} "
            f"finished on a prefill instance); reservations "
            f"{c['num_reservations_accepted']} accepted, "
            f"{c['num_reservations_refused']} refused, {c['num_reservations_expired']} expired")


HEADER = (f"{'policy':<16} {'rate/s':>7} {'done':>11} {'req/s':>7} {'goodput':>7} "
          f"{'SLO':>6} {'TTFT p50':>8} {'TTFT p99':>8} {'TPOT p50':>8} {'offl':>6} "
          f"{'recomp':>6} {'recomp tk':>9} {'sim s':>7}")


def replay_record(path: Path, profile_path: Path) -> int:
    try:
        profile = read_profile(profile_path)
        done = replay(read_record(path), profile)
    except (OSError, ValueError) as exc:
        print(f"kvstash sim: {exc}", file=sys.stderr)
        return 2
    print(f"replayed {done.calls} calls: {done.schedules} schedule() decisions, "
          f"{done.preemptions} preemptions, {done.copies} copies, {done.finishes} finishes")
    if done.step_ratios:
        ratios = spread(done.step_ratios)
        print(f"recorded step seconds / {profile.name}'s prediction, over "
              f"{len(done.step_ratios)} steps: p50 {ratios['p50']:.2f}, p90 {ratios['p90']:.2f}, "
              f"p99 {ratios['p99']:.2f}")
    turns = zip(done.steps, done.turns, strict=False)  # none for a last step
    if beyond := [turn - seconds for (_, seconds), turn in turns]:
        print(f"the loop's own time a step (its turn, schedule() to schedule(), less the "
              f"step): p50 {spread(beyond)['p50'] * 1e3:.2f} ms")
    if done.mismatch is not None:
        print(f"DECISIONS DIFFER at {done.mismatch}", file=sys.stderr)
        return 1
    print("every decision identical to the record")
    return 0


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.replay is not None:
        return replay_record(args.replay, args.profile)
    flags.check_flags(parser, args)
    args.policies = args.policies.split(",")
    if unknown := [x for x in args.policies if x not in POLICIES]:
        parser.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    for name in ("instances", "num_blocks", "block_size", "max_model_len", "max_num_seqs"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.prefill_instances or args.decode_instances:
        if args.prefill_instances <= 0 or args.decode_instances <= 0:
            parser.error("P/D needs both --prefill-instances and --decode-instances > 0")
        if args.instances != 1:
            parser.error("--instances counts mixed instances: give it or P/D pools, not both")
        if args.find is not None:
            parser.error("--find sizes mixed instances; with P/D pools, compare runs instead")
    if not 0 <= args.handoff_wait < math.inf:
        parser.error(f"--handoff-wait must be a finite number of seconds >= 0, "
                     f"got {args.handoff_wait}")
    if args.runs < 1 or not (args.jitter >= 0 and math.isfinite(args.jitter)):
        parser.error(f"--runs must be >= 1 and --jitter >= 0, got {args.runs}, {args.jitter}")
    if args.target is not None and (args.find is None or not 0 < args.target <= 1):
        parser.error(f"--target: the SLO attainment in (0, 1] --find sizes for, got {args.target}")
    try:
        slo = Slo(args.slo_ttft, args.slo_tpot)
        args.host_bytes = parse_bytes(args.cache_memory_budget)
        args.disk_bytes = parse_bytes(args.cache_disk_budget)
        args.cost = read_profile(args.profile)
        raw = flags.load_slice(args)
    except (ValueError, OSError) as exc:  # ProfileError, TraceError: ValueErrors
        print(f"kvstash sim: {exc}", file=sys.stderr)
        return 2
    if args.plots is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvstash sim: --plots needs matplotlib: pip install 'kvstash[bench]'",
                  file=sys.stderr)
            return 2
    args.bytes_per_block = args.cost.block_bytes(args.block_size)
    print(f"profile: {args.cost.name} ({args.profile})")
    args.core = compiled.running()
    print(f"core: {args.core}" + ("" if args.core == "compiled" else
                                  " (--core compiled: mypyc, 1.2-1.6x faster)"))
    # --find num-blocks tries pools of every size: none bounds the slice.
    pool = None if args.find == "num-blocks" else args.num_blocks * args.block_size
    try:  # every rate, before any run
        fitted = flags.fit_slices(args, raw, flags.max_context(args, args.max_model_len, pool))
    except (ValueError, TraceError) as exc:
        print(f"kvstash sim: {exc}", file=sys.stderr)
        return 2
    if args.find is not None:
        policy = args.policies[0]
        return find.least(args, policy, fitted[0][0], lambda: median_run(
            [summarize(r.records, slo) for r in simulate_runs(args, policy, fitted[0][0])]))
    print(HEADER)
    runs: list[dict[str, Any]] = []
    shown: list[plots.Run] = []  # each run, with --plots
    for trace, dropped in fitted:
        if dropped:  # the rows count only the requests simulated
            print(f"{'':<16} {dropped} requests longer than the context limit dropped")
        for policy in args.policies:
            started = time.perf_counter()
            result, *jittered_runs = simulate_runs(args, policy, trace)
            seconds = (time.perf_counter() - started) / args.runs
            summary = summarize(result.records, slo)
            print(row(policy, trace.rate, summary, result, seconds), flush=True)
            if args.prefill_instances:
                print(pd_row(result), flush=True)
            others = [summarize(r.records, slo) for r in jittered_runs]
            if others:
                print(f"{'':<16} {len(others) + 1} runs, median (min-max): "
                      f"{spread_text([summary, *others])}", flush=True)
            if args.plots is not None:
                shown.append(plotted(policy, trace.rate, result))
            runs.append({"policy": policy, "rate": trace.rate, "dropped": dropped,
                         "summary": asdict(summary), "counters": result.counters,
                         "sim_seconds": seconds, "virtual_seconds": result.end_s,
                         "jittered": [asdict(x) for x in others]})
    if args.json is not None:
        setup = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                 if k not in ("cost",)}
        setup["profile_json"] = args.cost.to_json()
        setup["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        body = metrics.strict({"setup": setup, "slo": asdict(slo), "runs": runs})
        args.json.write_text(json.dumps(body, indent=1, default=str, allow_nan=False))
        print(f"wrote {args.json}")
    if args.plots is not None:
        pools = (f"{args.prefill_instances} prefill + {args.decode_instances} decode instances"
                 if args.prefill_instances else f"{args.instances} instance(s)")
        write_plots(args.plots, shown, slo, f"kvstash sim: {args.cost.name}, {pools}")
        print(f"wrote plots to {args.plots}")
    return 0
