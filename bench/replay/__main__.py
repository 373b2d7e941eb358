"""Replay a request trace through kvstash, per preemption policy and
request rate, and report goodput under SLOs.

    python -m bench.replay --trace ../shared/traces/mooncake_conversation.jsonl \
        --count 200 --length-scale 0.0625 --rates 0.5,1,2 --model llama-small
    python -m bench.replay --synthetic 40 --rates 2 --policies recompute,offload
    python -m bench.replay --trace T.jsonl --address 127.0.0.1:50051   # a running stack

For each rate (the slice's arrivals rescaled to that mean, pattern kept) and
each policy (recompute, offload, auto, auto-fixed: see runs.POLICIES) a
fresh stack starts, one short request warms it up, the slice is replayed at
its arrival times (greedy, EOS ignored, the trace's output lengths), and the
stack stops. Prompts come from the hash ids (kvstash/workload/prompts.py).
A request never fails for lack of memory: the replay exits 1 where any did,
and unless every request completed in every run with the same output (the
oracle). Writes replay.json and PNG plots to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from bench.offload_vs_recompute import MAX_MODEL_LEN
from bench.replay import report
from bench.replay.runs import (
    DEFAULT_POLICIES,
    POLICIES,
    Endpoint,
    RunResult,
    pool_tokens,
    run_once,
    run_policy,
)
from gpu_worker.hf_config import parse_model_config
from kvstash.errors import KvstashError
from kvstash.launch.stack import StackConfig
from kvstash.workload import flags, plots
from kvstash.workload.metrics import Slo
from kvstash.workload.prompts import build_prompts
from kvstash.workload.trace import Trace, write_trace

GENERATED_MODELS = ("llama-small",)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_flags(p)
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"comma-separated, of: {', '.join(POLICIES)}")
    p.add_argument("--via", choices=("grpc", "http"), default="grpc",
                   help="kvstash's gRPC API, or OpenAI HTTP through smg")
    p.add_argument("--address", help="replay once against this running scheduler instead")
    p.add_argument("--cache-address", help="with --address: its cache, for occupancy")
    p.add_argument("--http-url", help="with --address and --via http: the smg in front of it")
    p.add_argument("--write-trace", type=Path,
                   help="also write the fitted slice here (Mooncake format, for another tool; "
                        "one rate); read it back with the --block-tokens it prints")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="seconds")
    p.add_argument("--model", default="tiny", help="tiny, llama-small or a checkpoint directory")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--cache-memory-budget", default="1GiB")
    p.add_argument("--worker-threads", type=int)
    p.add_argument("--scheduler-args", default="",
                   help="more scheduler flags for every run, e.g. '--init-new-token-ratio 0.3'")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds after its arrival a request may take before it is cancelled "
                        "and counted failed (0: no limit)")
    p.add_argument("--out", type=Path, default=Path("bench-results/replay"))
    args = p.parse_args(argv)
    flags.check_flags(p, args)
    if args.num_blocks <= 0:
        p.error("--num-blocks must be > 0")
    if not args.request_timeout >= 0:  # NaN too
        p.error("--request-timeout must be >= 0 seconds")
    args.request_timeout = args.request_timeout or None
    if args.write_trace is not None and len(args.rates) > 1:
        p.error("--write-trace writes one fitted slice: give one rate")
    if args.address and args.via == "http" and not args.http_url:
        p.error("--address with --via http needs --http-url (smg's base URL)")
    args.policies = args.policies.split(",")
    if unknown := [x for x in args.policies if x not in POLICIES]:
        p.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    return args


def model_max_len(model: str) -> int | None:
    """The longest sequence (prompt + output) `model` serves: a built-in
    model's, or a checkpoint directory's (its config.json's
    max_position_embeddings, as its worker reads it); None where unknown."""
    if model in MAX_MODEL_LEN:
        return MAX_MODEL_LEN[model]
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    raw = json.loads(config.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"{config} holds a JSON {type(raw).__name__}, not an object")
    return parse_model_config(raw).max_model_len


def commit() -> str:
    """This tree's commit (with -dirty when changed), or "" outside git."""
    done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip()


def replay_all(args: argparse.Namespace, base: StackConfig,
               fitted: list[tuple[Trace, int]]) -> list[RunResult]:
    runs = []
    for trace, dropped in fitted:
        prompts = build_prompts(trace, args.seed)
        inputs = sum(r.input_length for r in trace.requests)
        print(f"{len(trace.requests)} requests ({dropped} longer than {args.max_context} "
              f"dropped), {trace.duration_s:.1f} s of arrivals, {trace.rate:.3g}/s, {inputs} "
              f"prompt tokens", flush=True)
        for policy in (["external"] if args.address else args.policies):
            with tqdm(total=len(prompts), desc=f"{policy} @ {trace.rate:.3g}/s",
                      unit="req", file=sys.stderr) as bar:
                if args.address:
                    url = args.http_url if args.via == "http" else None
                    endpoint = Endpoint(args.address, args.cache_address, url, args.model)
                    run = asyncio.run(run_once(endpoint, policy, trace, prompts,
                                               lambda _: bar.update(), args.request_timeout))
                else:
                    run = run_policy(base, policy, trace, prompts, args.via == "http",
                                     lambda _: bar.update(), args.request_timeout)
            runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        slo = Slo(args.slo_ttft, args.slo_tpot)
        raw = flags.load_slice(args)
        # A running stack's pool is its own, not --num-blocks'.
        pool = (asyncio.run(pool_tokens(args.address)) if args.address
                else args.num_blocks * StackConfig().block_size)
        args.max_context = flags.max_context(args, model_max_len(args.model), pool)
        fitted = flags.fit_slices(args, raw, args.max_context)
        # Where the results go, made before any run: a bad path found after
        # the runs would lose them.
        args.out.mkdir(parents=True, exist_ok=True)
        flags.probe_writable(args.out)  # /proc, a read-only or another user's directory
        if args.write_trace is not None:
            write_trace(fitted[0][0], args.write_trace)
            print(f"wrote the fitted slice to {args.write_trace} (--block-tokens "
                  f"{fitted[0][0].block_tokens})", flush=True)
    except (ValueError, OSError, KvstashError) as exc:  # TraceError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvstash-replay-") as workdir:
        model = args.model
        if model in GENERATED_MODELS:
            from bench.worker_bench import write_checkpoint  # imports torch

            model = str(Path(workdir) / model)
            write_checkpoint(Path(model), args.model, "float32")
        base = StackConfig(model=model, dtype=args.dtype, num_blocks=args.num_blocks,
                           max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           cache_memory_budget=args.cache_memory_budget,
                           worker_threads=args.worker_threads,
                           scheduler_args=tuple(shlex.split(args.scheduler_args)))
        try:
            runs = replay_all(args, base, fitted)
        except (ValueError, OSError, RuntimeError, KvstashError) as exc:  # a stack that
            # would not start (a bad --model, --scheduler-args, budget): was a traceback
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(report.table(runs, slo))
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    setup |= {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "commit": commit(), "cpus": os.cpu_count()}
    report.write_json(args.out / "replay.json", runs, slo, setup)
    title = (f"{args.model}, {len(fitted[0][0].requests)} requests, "
             f"lengths x{args.length_scale:g}")
    plotted = [run.plotted() for run in runs]
    last = [run for run in plotted if run.rate == runs[-1].rate]
    plots.latency_cdfs(last, slo,
                       args.out / "latency_cdf.png", f"{title}, {runs[-1].rate:.3g} req/s")
    plots.occupancy(last, args.out / "occupancy.png",
                    f"{title}, {runs[-1].rate:.3g} req/s")
    if len(args.rates) > 1:
        plots.goodput_by_rate(plotted, slo, args.out / "goodput.png", title)
    print(f"wrote {args.out}/replay.json and plots")
    failed = report.failures(runs)
    for line in failed:
        print(f"REQUESTS FAILED: {line}", file=sys.stderr)
    mismatches = report.output_mismatches(runs)
    for line in mismatches[:20]:
        print(f"ORACLE FAILED: {line}", file=sys.stderr)
    if len(mismatches) > 20:
        print(f"ORACLE FAILED: and {len(mismatches) - 20} more", file=sys.stderr)
    if failed or mismatches:
        return 1
    print(f"oracle: {len(runs[0].records)} requests compared across {len(runs)} run(s), each "
          f"completed in every run with the same output")
    return 0


if __name__ == "__main__":
    # Ctrl-C stops the run, its stack stopped on the way out (running_stack).
    # A background job of a shell inherits SIGINT ignored, and keeps it so.
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # was a traceback from inside asyncio
        print("python -m bench.replay: stopped (its stacks with it)", file=sys.stderr)
        sys.exit(130)
