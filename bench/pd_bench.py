"""Mixed vs P/D disaggregation: the same workload side by side in one run.

    python -m bench.pd_bench [--requests 32] [--max-tokens 64] [--rounds 4]
                             [--model tiny|llama-small|llama-1b|DIR] [--device auto]

Starts two stacks on this machine and keeps both up: a mixed one (cache,
worker, scheduler) and a P/D one (cache, a decode instance and a prefill
instance, each a scheduler and its worker; clients call the prefill one).
Each round sends the same N streaming requests (token-id prompts of
--min/--max-prompt-tokens, greedy, ignore_eos, max_tokens each) to one stack
at once, then to the other; rounds alternate which goes first (ABBA), so a
burst of load elsewhere on a shared machine hits both. A first round on
each, on other prompts, warms up and is not counted; every round has prompts
of its own, so no prefix is cached from an earlier one. Every worker runs
torch on --worker-threads threads (1: one core each, as one accelerator
each; torch's default, one per core, has P/D's two workers fight over the
cores and collapses when anything else runs on the machine).

Per request, on the client: TTFT (the call to the first token) and TPOT
((last token - first token) / (tokens - 1)), pooled over the rounds, p50 and
p99 (nearest rank); the ratio is P/D / mixed. TPOT from token 2 leaves out
the first gap, where P/D's handoff lies. Per P/D request:
  handoff bytes    bytes_handed_off / num_handoffs of the prefill instance's
                   stats over the counted rounds;
  handoff time     server side: kvstash_scheduler_handoff_seconds sum / count
                   from the prefill instance's /metrics (from its first token
                   sampled to the decode instance's first token); client
                   side: the gap between the first and second token's
                   arrival, shown for mixed too (there: the next step).
The outputs of mixed and P/D must be token-identical, request by request (the
project's oracle): exit status 1 if not, or if a request fails or ends short.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.load_test import Percentiles, percentiles
from kvstash import errors
from kvstash.client import Client
from kvstash.common.units import KIB
from kvstash.launch.stack import Stack, StackConfig, running_stack
from kvstash.v1 import scheduler_pb2

MODES = ("mixed", "P/D")
HANDOFF_METRIC = "kvstash_scheduler_handoff_seconds"
TOKEN_ID_RANGE = 256  # valid for the tiny model and any real vocabulary
DEFAULTS = StackConfig()
# Random-weight checkpoints bench.worker_bench writes (its SHAPES).
GENERATED_MODELS = ("llama-small", "llama-1b")


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the client saw it; times in seconds."""

    token_ids: list[int]
    finish_reason: str | None
    ttft_s: float
    tpot_s: float | None  # None with fewer than two tokens
    gap_s: float | None  # the first token's arrival to the second's
    # TPOT without that gap: (last - second) / (tokens - 2); None below 3 tokens
    later_tpot_s: float | None


@dataclass(slots=True)
class Side:
    """One configuration's measured rounds."""

    samples: list[Sample] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)  # per round
    outputs: list[list[list[int]]] = field(default_factory=list)  # per round, per request

    def pct_ms(self, name: str) -> Percentiles | None:
        values = [getattr(s, name) for s in self.samples]
        return percentiles([v * 1e3 for v in values if v is not None])

    def mean_gap_ms(self) -> float | None:
        gaps = [s.gap_s for s in self.samples if s.gap_s is not None]
        return statistics.fmean(gaps) * 1e3 if gaps else None

    def tokens_per_s(self) -> float:
        num_tokens = sum(len(s.token_ids) for s in self.samples)
        return num_tokens / sum(self.wall_s)


def make_prompts(round_index: int, args: argparse.Namespace) -> list[list[int]]:
    """Round `round_index`'s prompts (-1: the warm-up's), the same for both sides."""
    prompts = []
    for i in range(args.requests):
        rng = random.Random(round_index * 1_000_003 + i)
        length = rng.randint(args.min_prompt_tokens, args.max_prompt_tokens)
        prompts.append([rng.randrange(TOKEN_ID_RANGE) for _ in range(length)])
    return prompts


async def one_request(client: Client, prompt: list[int], max_tokens: int) -> Sample:
    start = time.perf_counter()
    token_ids: list[int] = []
    arrivals: list[float] = []  # per token
    finish_reason = None
    try:
        async for delta in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True,
                                           timeout_s=600):
            if delta.token_ids:
                now = time.perf_counter()
                token_ids += delta.token_ids
                arrivals += [now] * len(delta.token_ids)
            finish_reason = delta.finish_reason or finish_reason
    except errors.KvstashError as exc:  # reported with the outputs, not raised
        finish_reason = f"error {exc}"
    if not arrivals:
        return Sample(token_ids, finish_reason, time.perf_counter() - start, None, None, None)
    n = len(arrivals)
    return Sample(token_ids, finish_reason, arrivals[0] - start,
                  (arrivals[-1] - arrivals[0]) / (n - 1) if n > 1 else None,
                  arrivals[1] - arrivals[0] if n > 1 else None,
                  (arrivals[-1] - arrivals[1]) / (n - 2) if n > 2 else None)


async def run_round(client: Client, prompts: list[list[int]], max_tokens: int,
                    side: Side | None) -> None:
    """Every prompt at once; recorded in `side` unless None (a warm-up)."""
    start = time.perf_counter()
    samples = await asyncio.gather(*[one_request(client, p, max_tokens) for p in prompts])
    if side is not None:
        side.wall_s.append(time.perf_counter() - start)
        side.samples += samples
        side.outputs.append([s.token_ids for s in samples])


def free_port() -> int:
    """A port nothing listens on now (/metrics cannot bind port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape_handoff(port: int) -> tuple[float, float]:
    """(sum, count) of the prefill instance's handoff histogram."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = {s.name: s.value for family in text_string_to_metric_families(text)
             for s in family.samples if s.name.startswith(HANDOFF_METRIC)}
    return found.get(HANDOFF_METRIC + "_sum", 0.0), found.get(HANDOFF_METRIC + "_count", 0.0)


@dataclass(frozen=True, slots=True)
class Counters:
    """Both stacks' counters at one moment."""

    mixed: scheduler_pb2.SchedulerStats
    prefill: scheduler_pb2.SchedulerStats  # the P/D stack's instances
    decode: scheduler_pb2.SchedulerStats
    handoff: tuple[float, float]  # the prefill instance's handoff histogram: (sum, count)


async def read_counters(clients: dict[str, Client], metrics_port: int) -> Counters:
    return Counters(await clients["mixed"].stats(), await clients["prefill"].stats(),
                    await clients["decode"].stats(),
                    await asyncio.to_thread(scrape_handoff, metrics_port))


async def measure(mixed: Stack, pd: Stack, metrics_port: int, args: argparse.Namespace
                  ) -> tuple[dict[str, Side], Counters, Counters]:
    """The warm-up, then the rounds; the counters before and after the rounds."""
    assert pd.decode_scheduler is not None
    async with (Client(mixed.address) as mixed_client, Client(pd.address) as pd_client,
                Client(pd.decode_scheduler.address) as decode_client):
        clients = {"mixed": mixed_client, "P/D": pd_client}
        for client in clients.values():
            await run_round(client, make_prompts(-1, args), args.max_tokens, None)
        by_role = {"mixed": mixed_client, "prefill": pd_client, "decode": decode_client}
        before = await read_counters(by_role, metrics_port)
        sides = {mode: Side() for mode in MODES}
        for r in range(args.rounds):
            prompts = make_prompts(r, args)
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                await run_round(clients[mode], prompts, args.max_tokens, sides[mode])
            print(f"round {r + 1}/{args.rounds}: mixed {sides['mixed'].wall_s[-1]:.1f} s, "
                  f"P/D {sides['P/D'].wall_s[-1]:.1f} s", flush=True)
        return sides, before, await read_counters(by_role, metrics_port)


def ratio(pd: float | None, mixed: float | None) -> str:
    return "-" if pd is None or not mixed else f"{pd / mixed:.2f}"


def report(sides: dict[str, Side], before: Counters, after: Counters,
           args: argparse.Namespace) -> tuple[list[str], dict[str, object]]:
    """The printed lines, and the same figures for --json."""
    lines = [f"{'':<26}{'mixed':>10}{'P/D':>10}{'P/D / mixed':>13}"]
    figures: dict[str, object] = {}
    rows = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("token 1->2 gap", "gap_s"),
            ("TPOT from token 2", "later_tpot_s"))
    for label, name in rows:
        m, p = sides["mixed"].pct_ms(name), sides["P/D"].pct_ms(name)
        for q in ("p50", "p99"):
            mv, pv = (None if x is None else getattr(x, q) for x in (m, p))
            lines.append(f"{label + ' ' + q + ' ms':<26}{fmt(mv):>10}{fmt(pv):>10}"
                         f"{ratio(pv, mv):>13}")
            figures[f"{name[:-2]}_{q}_ms"] = {"mixed": mv, "pd": pv}
    tps = {mode: sides[mode].tokens_per_s() for mode in MODES}
    lines.append(f"{'output tokens/s':<26}{tps['mixed']:>10.0f}{tps['P/D']:>10.0f}"
                 f"{ratio(tps['P/D'], tps['mixed']):>13}")
    figures["tokens_per_s"] = {"mixed": tps["mixed"], "pd": tps["P/D"]}

    def delta(side: str, *names: str) -> int:
        return sum(int(getattr(getattr(after, side), n) - getattr(getattr(before, side), n))
                   for n in names)

    handoffs = delta("prefill", "num_handoffs")
    failures = delta("prefill", "num_handoff_failures")
    handoff_bytes = delta("prefill", "bytes_handed_off") / handoffs if handoffs else None
    seconds, count = (a - b for a, b in zip(after.handoff, before.handoff, strict=True))
    handoff_ms = seconds / count * 1e3 if count else None
    gaps = {mode: sides[mode].mean_gap_ms() for mode in MODES}
    preemptions = {side: delta(side, "num_preemptions_offload", "num_preemptions_recompute")
                   for side in ("mixed", "prefill", "decode")}
    lines += [
        "",
        f"P/D: {handoffs} of {args.requests * args.rounds} requests' KV handed off, "
        f"{failures} handoff failures (finished on the prefill instance); decode instance "
        f"reservations accepted {delta('decode', 'num_reservations_accepted')}, refused "
        f"{delta('decode', 'num_reservations_refused')}, expired "
        f"{delta('decode', 'num_reservations_expired')}",
        "handoff bytes per request (prefill bytes_handed_off / num_handoffs): "
        + ("-" if handoff_bytes is None else f"{handoff_bytes / KIB:.1f} KiB"),
        f"handoff time per request, server (prefill {HANDOFF_METRIC} sum / count, first "
        f"token sampled to the decode instance's first, {count:.0f} observed): "
        f"{fmt(handoff_ms)} ms mean",
        f"handoff time per request, client (token 1->2 gap, mean): P/D {fmt(gaps['P/D'])} ms, "
        f"mixed {fmt(gaps['mixed'])} ms (the next step there)",
        f"preemptions: mixed {preemptions['mixed']}, P/D prefill {preemptions['prefill']}, "
        f"P/D decode {preemptions['decode']}",
    ]
    figures.update(num_requests=args.requests * args.rounds, num_handoffs=handoffs,
                   num_handoff_failures=failures, handoff_bytes_per_request=handoff_bytes,
                   handoff_ms_server_mean=handoff_ms,
                   gap_ms_mean={"mixed": gaps["mixed"], "pd": gaps["P/D"]},
                   num_preemptions=preemptions,
                   wall_s={"mixed": sides["mixed"].wall_s, "pd": sides["P/D"].wall_s})
    return lines, figures


def fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def conclude(lines: list[str], figures: dict[str, object], problems: list[str],
             all_good: str, json_path: Path | None, ok_key: str) -> int:
    """Prints the report, then `all_good` or each problem; writes the figures
    (with `ok_key`: no problem) to `json_path`. The exit status: 1 on a problem."""
    print("\n".join(lines))
    if not problems:
        print(all_good)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    if json_path is not None:
        figures[ok_key] = not problems
        json_path.write_text(json.dumps(figures, indent=1) + "\n")
    return 1 if problems else 0


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     *names: str) -> None:
    """parser.error for the first of these options that is not > 0."""
    for name in names:
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")


def check_outputs(sides: dict[str, Side], max_tokens: int) -> list[str]:
    """What breaks the oracle: outputs that differ between the sides, or end short."""
    problems = []
    for mode in MODES:
        short = [s for s in sides[mode].samples
                 if s.finish_reason != "length" or len(s.token_ids) != max_tokens]
        if short:
            problems.append(f"{mode}: {len(short)} requests did not end with {max_tokens} "
                            f"tokens (e.g. {len(short[0].token_ids)}, {short[0].finish_reason})")
    pairs = [(r, i) for r, (m, p) in enumerate(zip(sides["mixed"].outputs, sides["P/D"].outputs,
                                                    strict=True))
             for i, (a, b) in enumerate(zip(m, p, strict=True)) if a != b]
    if pairs:
        problems.append(f"{len(pairs)} requests differ between mixed and P/D "
                        f"(round, request): {pairs[:8]}")
    return problems


def stack_configs(args: argparse.Namespace, model: str, metrics_port: int
                  ) -> tuple[StackConfig, StackConfig]:
    mixed = StackConfig(model=model, device=args.device, dtype=args.dtype,
                        num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                        cache_memory_budget=args.cache_memory_budget,
                        worker_args=("--num-threads", str(args.worker_threads)))
    pd = dataclasses.replace(mixed, pd=True,
                             prefill_scheduler_args=("--metrics-port", str(metrics_port)))
    return mixed, pd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pd_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32, help="concurrent, per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-prompt-tokens", type=int, default=16)
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4,
                        help="measured rounds per side, after one warm-up round each")
    parser.add_argument("--model", default="tiny",
                        help="tiny, llama-small or llama-1b (random weights, written here by "
                             "bench.worker_bench) or a checkpoint directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto",
                        help="auto: the checkpoint's (llama-*: bfloat16; float32 is faster on "
                             "a CPU), float64 for tiny")
    parser.add_argument("--num-blocks", type=int, default=DEFAULTS.num_blocks,
                        help="KV blocks per worker")
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs)
    parser.add_argument("--cache-memory-budget", default=DEFAULTS.cache_memory_budget,
                        help="per cache service (two run)")
    parser.add_argument("--worker-threads", type=int, default=1,
                        help="torch threads of every worker; 0 = torch's default (one per "
                             "core: P/D's two workers then oversubscribe them)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    require_positive(parser, args, "requests", "max_tokens", "min_prompt_tokens", "rounds")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2: a one-token request is never handed off")
    if args.max_prompt_tokens < args.min_prompt_tokens:
        parser.error(f"--max-prompt-tokens {args.max_prompt_tokens} < --min-prompt-tokens "
                     f"{args.min_prompt_tokens}")
    with tempfile.TemporaryDirectory(prefix="kvstash-pd-bench-") as workdir:
        model = args.model
        if model in GENERATED_MODELS:
            from bench.worker_bench import write_checkpoint  # imports torch

            model = str(Path(workdir) / model)
            write_checkpoint(Path(model), args.model)
        metrics_port = free_port()
        mixed_config, pd_config = stack_configs(args, model, metrics_port)
        print(f"{args.requests} concurrent requests per round, prompts "
              f"{args.min_prompt_tokens}-{args.max_prompt_tokens} tokens, {args.max_tokens} "
              f"output tokens, greedy; {args.model} on {args.device}, torch threads per "
              f"worker: {args.worker_threads}; 1 warm-up + {args.rounds} rounds per side, "
              "alternating ...", flush=True)
        with contextlib.ExitStack() as stacks:
            mixed = stacks.enter_context(running_stack(mixed_config))
            pd = stacks.enter_context(running_stack(pd_config))
            sides, before, after = asyncio.run(measure(mixed, pd, metrics_port, args))
    lines, figures = report(sides, before, after, args)
    return conclude(lines, figures, check_outputs(sides, args.max_tokens),
                    f"outputs: all {args.requests * args.rounds} requests token-identical "
                    "between mixed and P/D", args.json, "outputs_identical")


if __name__ == "__main__":
    sys.exit(main())
