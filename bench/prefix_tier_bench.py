"""The prefix tier, measured on two instances sharing one cache service, side
by side: off (--prefix-segment-tokens 0), on writing through (the default:
segments stored once prefilled) and on writing back (stored when about to be
evicted); a fresh stack per run.

    shared  one --prompt-len prompt served on instance A, then asked on B:
            B's TTFT with the tier on vs off (goal: at most 0.25x, writing
            through; writing back, A has evicted nothing yet: no hit)
    unique  --unique-requests prompts, no two sharing a segment, sent at once
            to both instances: throughput, which is what saving every prompt
            costs a workload that never reads one back (goal: within 5%)
    trace   --conversations multi-turn conversations of the Mooncake
            conversation trace (every turn of each, in order; prefix structure
            kept, lengths scaled, arrivals compressed to --rate), through smg's
            round_robin policy so turns change instance: TTFT p50/p99, prompt
            tokens prefilled, tier hit rate, throughput; every output must be
            the same with the tier on and off

    python -m bench.prefix_tier_bench [--model llama-small] [--parts shared,unique,trace]

Writes prefix_tier.json (and the trace's latency CDFs as a PNG) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.replay.__main__ import commit
from bench.replay.drive import Sender, grpc_sender, http_sender, replay
from kvstash.client import Client
from kvstash.launch.stack import StackConfig, running_stack
from kvstash.workload import plots
from kvstash.workload.metrics import RequestRecord, Slo, summarize
from kvstash.workload.prompts import ALPHABET, build_prompts
from kvstash.workload.trace import Trace, fit, read_trace

GOAL_TTFT_RATIO = 0.25
GOAL_UNIQUE_THROUGHPUT = 0.95
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
# What a run reports of each instance's SchedulerStats, summed.
COUNTERS = ("num_prompt_tokens", "num_prefix_hit_tokens", "num_tier_hit_tokens",
            "num_recomputed_tokens", "num_tier_saves", "bytes_tier_saved",
            "bytes_tier_loaded", "num_tier_load_failures", "num_tier_loads_declined")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_tier_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-small",
                   help="llama-small (random float32 weights, written here, its positions "
                        "stretched to fit --prompt-len), tiny, or a checkpoint directory")
    p.add_argument("--parts", default="shared,unique,trace")
    p.add_argument("--segment-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=4096, help="shared: the prompt's tokens")
    p.add_argument("--unique-requests", type=int, default=24)
    p.add_argument("--unique-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3, help="unique: rounds per setting")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--conversations", type=int, default=10,
                   help="trace: conversations of at least --turns turns, the first found")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--length-scale", type=float, default=0.125)
    p.add_argument("--rate", type=float, default=0.5, help="trace: mean arrivals/s")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks per instance")
    p.add_argument("--slo-ttft", type=float, default=10.0)
    p.add_argument("--slo-tpot", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=Path("bench-results/prefix-tier"))
    args = p.parse_args(argv)
    args.parts = args.parts.split(",")
    if unknown := set(args.parts) - {"shared", "unique", "trace"}:
        p.error(f"unknown parts {sorted(unknown)}")
    if args.segment_tokens <= 0:
        p.error("--segment-tokens must be > 0 (the tier-on runs need segments)")
    return args


SETTINGS = ("off", "through", "back")


def stack_config(args: argparse.Namespace, model: str, setting: str,
                 gateway: bool = False) -> StackConfig:
    tier = ("--prefix-segment-tokens", "0") if setting == "off" else (
        "--prefix-segment-tokens", str(args.segment_tokens), "--prefix-write", setting)
    return StackConfig(model=model, instances=2, num_blocks=args.num_blocks, gateway=gateway,
                       gateway_policy="round_robin", scheduler_args=tier)


async def counters(addresses: Sequence[str]) -> dict[str, int]:
    total = dict.fromkeys(COUNTERS, 0)
    for address in addresses:
        async with Client(address) as client:
            stats = await client.stats()
        for name in COUNTERS:
            total[name] += int(getattr(stats, name))
    return total


async def settled(addresses: Sequence[str], timeout_s: float = 120.0) -> dict[str, int]:
    """The summed counters once no save is in flight (two polls agree)."""
    last = await counters(addresses)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = await counters(addresses)
        if now == last:
            return now
        last = now
    return last


async def timed(address: str, prompt: list[int], max_tokens: int = 4) -> float:
    """Seconds to the first token of one greedy request."""
    async with Client(address) as client:
        sent = time.perf_counter()
        async for delta in client.generate(prompt, max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True):
            if delta.token_ids:
                return time.perf_counter() - sent
    raise RuntimeError("no token came back")


async def warm(addresses: Sequence[str]) -> None:
    for address in addresses:
        await timed(address, [65] * 8, 2)


def prompt_of(seed: int, length: int) -> list[int]:
    """Pseudo-random printable-ASCII ids (every model here has them, and smg
    sends them as text), the same for the same seed."""
    return random.Random(f"prefix-tier:{seed}").choices(ALPHABET, k=length)


async def shared_run(addresses: Sequence[str], prompt: list[int]) -> dict[str, float]:
    a, b = addresses
    await warm(addresses)
    ttft_a = await timed(a, prompt)
    await settled(addresses)
    ttft_b = await timed(b, prompt)
    return {"ttft_a_s": ttft_a, "ttft_b_s": ttft_b, **await settled(addresses)}


async def unique_run(addresses: Sequence[str], rounds: list[list[list[int]]],
                     max_tokens: int) -> dict[str, Any]:
    """Each round's prompts sent at once, half to each instance: each
    round's requests/s (rounds, not one run: this machine is noisy)."""
    await warm(addresses)
    clients = [Client(a) for a in addresses]
    rates = []
    for prompts in rounds:
        started = time.perf_counter()
        await asyncio.gather(*(
            clients[i % 2].complete(p, max_tokens=max_tokens, ignore_eos=True)
            for i, p in enumerate(prompts)))
        rates.append(len(prompts) / (time.perf_counter() - started))
    for client in clients:
        await client.close()
    return {"rounds_per_s": rates, **await settled(addresses)}


def round_robin(senders: Sequence[Sender]) -> Sender:
    turn = iter(range(1 << 62))

    async def send(record: RequestRecord, prompt: list[int], max_tokens: int) -> None:
        await senders[next(turn) % len(senders)](record, prompt, max_tokens)
    return send


async def trace_run(addresses: Sequence[str], http_url: str | None, model: str,
                    trace, prompts) -> tuple[list[RequestRecord], dict[str, int]]:
    await warm(addresses)
    before = await counters(addresses)
    if http_url is not None:
        send = http_sender(http_url, model)
        records = await replay(trace, prompts, send)
    else:
        clients = [Client(a) for a in addresses]
        records = await replay(trace, prompts, round_robin([grpc_sender(c) for c in clients]))
        for client in clients:
            await client.close()
    after = await settled(addresses)
    return records, {k: after[k] - before[k] for k in COUNTERS}


def run_settings(args: argparse.Namespace, model: str, part: str,
                 body: Callable[[list[str], str | None], object], passes: int = 1
                 ) -> dict[str, Any]:
    """`body(addresses, gateway url)` on a fresh stack per setting, the
    settings in turn `passes` times (so a machine getting slower or faster
    meanwhile shows in every setting alike); each setting's results, a list
    with passes > 1."""
    out: dict[str, Any] = {setting: [] for setting in SETTINGS}
    for n in range(passes):
        for setting in SETTINGS:
            config = stack_config(args, model, setting, gateway=part == "trace")
            print(f"{part}: tier {setting}, pass {n + 1} of {passes} ...", flush=True,
                  file=sys.stderr)
            with running_stack(config) as stack:
                url = stack.gateway.url if stack.gateway is not None else None
                out[setting].append(asyncio.run(body(stack.addresses, url)))  # type: ignore[arg-type]
    return out if passes > 1 else {setting: runs[0] for setting, runs in out.items()}


def prefilled(c: dict[str, int]) -> int:
    return (c["num_prompt_tokens"] - c["num_prefix_hit_tokens"] - c["num_tier_hit_tokens"]
            + c["num_recomputed_tokens"])


def conversations(trace: Trace, count: int, min_turns: int) -> Trace:
    """Every turn of the first `count` conversations with at least
    `min_turns` turns, in arrival order. A conversation is the requests
    whose first two hash ids agree (its system prompt, then its first turn)."""
    turns: dict[tuple[int, ...], list[int]] = {}
    for i, request in enumerate(trace.requests):
        turns.setdefault(request.hash_ids[:2], []).append(i)
    chosen = [ids for ids in turns.values() if len(ids) >= min_turns][:count]
    kept = sorted(i for ids in chosen for i in ids)
    if not kept:
        raise ValueError(f"no conversation of {min_turns} turns in the trace")
    first = trace.requests[kept[0]].arrival_s
    return Trace(tuple(dataclasses.replace(trace.requests[i],
                                           arrival_s=trace.requests[i].arrival_s - first)
                       for i in kept), trace.block_tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, object] = {"setup": {
        **{k: str(v) for k, v in vars(args).items()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit()}}
    failed = []
    with tempfile.TemporaryDirectory(prefix="kvstash-prefix-tier-") as workdir:
        model = args.model
        if model == "llama-small":
            from bench.worker_bench import write_checkpoint  # imports torch

            model = str(Path(workdir) / model)
            write_checkpoint(Path(model), args.model, "float32",
                             max_positions=max(4096, args.prompt_len + 64))
        if "shared" in args.parts:
            prompt = prompt_of(1, args.prompt_len)
            runs = run_settings(args, model, "shared",
                                lambda addresses, _: shared_run(addresses, prompt))
            ratios = {k: runs[k]["ttft_b_s"] / runs["off"]["ttft_b_s"] for k in SETTINGS}
            results["shared"] = {**runs, "ttft_b_ratio": ratios}
            print(f"\nshared prompt of {args.prompt_len} tokens, served on A then asked on B")
            # Prefilled on B: all the tokens both prefilled, less A's prompt
            # (the warm-ups' few tokens included).
            print(f"{'tier':<8} {'TTFT A s':>9} {'TTFT B s':>9} {'B / off':>8} "
                  f"{'B prefilled':>12} {'B from tier':>12}")
            for name, run in runs.items():
                print(f"{name:<8} {run['ttft_a_s']:9.3f} {run['ttft_b_s']:9.3f} "
                      f"{ratios[name]:8.3f} {prefilled(run) - args.prompt_len:12d} "
                      f"{run['num_tier_hit_tokens']:12d}")
            met = ratios["through"] <= GOAL_TTFT_RATIO
            print(f"TTFT on B, tier on (through) / off: {ratios['through']:.3f}x "
                  f"(goal <= {GOAL_TTFT_RATIO}x: {'met' if met else 'MISSED'})")
            failed += [] if met else ["shared"]
        if "unique" in args.parts:
            rounds = [[prompt_of(1000 * r + i, args.unique_len)
                       for i in range(args.unique_requests)] for r in range(args.rounds)]
            passes = run_settings(args, model, "unique",
                                  lambda addresses, _: unique_run(addresses, rounds, 16), 2)
            runs = {setting: {
                "rounds_per_s": [r for p in done for r in p["rounds_per_s"]],
                "requests_per_s": statistics.median(r for p in done for r in p["rounds_per_s"]),
                **{k: sum(p[k] for p in done) for k in COUNTERS}}
                for setting, done in passes.items()}
            ratios = {k: runs[k]["requests_per_s"] / runs["off"]["requests_per_s"]
                      for k in SETTINGS}
            results["unique"] = {**runs, "throughput_ratio": ratios}
            print(f"\n{args.rounds} rounds of {args.unique_requests} prompts of "
                  f"{args.unique_len} tokens, no reuse, each setting twice in turn "
                  "(median round)")
            for name, run in runs.items():
                print(f"{name:<8} {run['requests_per_s']:.3f} req/s ({ratios[name]:.3f}x), "
                      f"{run['num_tier_saves']} segments saved, "
                      f"{run['bytes_tier_saved'] / 2**20:.0f} MiB")
            met = ratios["through"] >= GOAL_UNIQUE_THROUGHPUT
            print(f"throughput, tier on (through) / off: {ratios['through']:.3f}x "
                  f"(goal >= {GOAL_UNIQUE_THROUGHPUT}x: {'met' if met else 'MISSED'})")
            failed += [] if met else ["unique"]
        if "trace" in args.parts:
            raw = conversations(read_trace(args.trace, 0, 3000), args.conversations, args.turns)
            trace, dropped = fit(raw, args.length_scale, rate=args.rate,
                                 max_context=args.max_context)
            prompts = build_prompts(trace, 0)
            runs = run_settings(args, model, "trace", lambda addresses, url: trace_run(
                addresses, url, args.model if url else model, trace, prompts))
            slo = Slo(args.slo_ttft, args.slo_tpot)
            rows = {}
            print(f"\nMooncake conversation, {args.conversations} conversations: "
                  f"{len(trace.requests)} requests ({dropped} dropped), "
                  f"lengths x{args.length_scale}, {trace.rate:.2f} req/s, smg round_robin")
            print(f"{'tier':<8} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
                  f"{'prefilled':>10} {'tier hit':>9}")
            for name, (records, c) in runs.items():
                s = summarize(records, slo)
                hit = c["num_tier_hit_tokens"] / max(1, c["num_prompt_tokens"])
                rows[name] = {"summary": dataclasses.asdict(s), "counters": c, "hit_rate": hit}
                print(f"{name:<8} {s.requests_per_s:6.3f} {s.ttft_s['p50']:9.3f} "
                      f"{s.ttft_s['p99']:9.3f} {prefilled(c):10d} {hit:9.1%}")
            results["trace"] = rows
            outputs = [[r.output for r in records] for records, _ in runs.values()]
            if any(o != outputs[0] for o in outputs):
                print("OUTPUT MISMATCH between the settings", file=sys.stderr)
                failed.append("trace")
            for name, (records, _) in runs.items():
                if errors := [r.error for r in records if r.error]:
                    print(f"REQUESTS FAILED with tier {name}: {len(errors)} of "
                          f"{len(records)} ({', '.join(sorted(set(errors))[:3])})",
                          file=sys.stderr)
                    failed.append(f"trace, tier {name}")
            args.out.mkdir(parents=True, exist_ok=True)
            plots.latency_cdfs(
                [plots.Run(f"tier {name}", trace.rate, records)
                 for name, (records, _) in runs.items()],
                slo, args.out / "latency_cdf.png", "prefix tier on vs off, 2 instances")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_tier.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {args.out}/prefix_tier.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
