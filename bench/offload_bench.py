"""Offload vs recompute under KV-memory pressure, side by side in one run.

Many concurrent requests with long prompts and long outputs on a KV pool a
fraction of their demand. For each preemption mode: completed requests per
second, preemptions, tokens recomputed, and time per output token (p50/p99).
Run: python -m bench.offload_bench [--requests 48] [--max-tokens 192]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

from kvstash.client import Client
from kvstash.common.units import MIB
from kvstash.launch.stack import StackConfig, running_stack


@dataclass(slots=True)
class Run:
    mode: str
    init_ratio: float
    wall_s: float
    num_requests: int
    num_preemptions: int
    num_recomputed_tokens: int
    mib_offloaded: float
    tpot_ms: list[float]
    outputs: list[list[int]]


def make_prompts(num_requests: int) -> list[list[int]]:
    return [[(i * 131 + j * 17 + 5) % 256 for j in range(128 + (i * 37) % 256)]
            for i in range(num_requests)]


async def _timed(client: Client, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    tokens: list[int] = []
    first = last = 0.0
    async for delta in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True):
        if delta.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens.extend(delta.token_ids)
    return tokens, (last - first) / max(1, len(tokens) - 1) * 1000


async def _workload(address: str, mode: str, init_ratio: float, prompts: list[list[int]],
                    max_tokens: int) -> Run:
    async with Client(address) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*[_timed(client, p, max_tokens) for p in prompts])
        wall = time.perf_counter() - start
        stats = await client.stats()
    return Run(
        mode=mode, init_ratio=init_ratio, wall_s=wall, num_requests=len(prompts),
        num_preemptions=stats.num_preemptions_offload + stats.num_preemptions_recompute,
        num_recomputed_tokens=stats.num_recomputed_tokens,
        mib_offloaded=stats.bytes_offloaded / MIB,
        tpot_ms=[t for _, t in done], outputs=[o for o, _ in done],
    )


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--num-blocks", type=int, default=96)
    args = parser.parse_args(argv)
    prompts = make_prompts(args.requests)
    demand = sum(-(-(len(p) + args.max_tokens) // 16) for p in prompts)
    print(f"{args.requests} requests, prompts 128-383 tokens, {args.max_tokens} output tokens; "
          f"pool {args.num_blocks} blocks = {args.num_blocks / demand:.0%} of the demand")
    runs = []
    # 0.7 is the default; 0.1 admits optimistically, so preemption is frequent.
    for init_ratio in (0.7, 0.1):
        for mode in ("recompute", "offload"):
            config = StackConfig(num_blocks=args.num_blocks, preemption_mode=mode,
                                 scheduler_args=("--init-new-token-ratio", str(init_ratio)))
            with running_stack(config) as s:
                runs.append(asyncio.run(
                    _workload(s.address, mode, init_ratio, prompts, args.max_tokens)))
    header = (f"{'init ratio':<10} {'mode':<10} {'req/s':>7} {'wall s':>7} {'preempt':>8} "
              f"{'recomputed':>11} {'MiB offl.':>10} {'TPOT p50 ms':>12} {'TPOT p99 ms':>12}")
    print(header)
    for r in runs:
        print(f"{r.init_ratio:<10} {r.mode:<10} {r.num_requests / r.wall_s:>7.2f} {r.wall_s:>7.1f} "
              f"{r.num_preemptions:>8} {r.num_recomputed_tokens:>11} {r.mib_offloaded:>10.1f} "
              f"{_pct(r.tpot_ms, 0.5):>12.1f} {_pct(r.tpot_ms, 0.99):>12.1f}")
    for recompute, offload in zip(runs[::2], runs[1::2], strict=True):
        print(f"init ratio {recompute.init_ratio}: offload/recompute req/s "
              f"{recompute.wall_s / offload.wall_s:.2f}x, outputs identical: "
              f"{recompute.outputs == offload.outputs}")


if __name__ == "__main__":
    main()
