"""`kvstash sim --find`: the least of one resource that keeps SLO attainment
at or above a target on a trace, for one policy at one rate.

    instances               1, 2, 4, ... then bisected: the fewest instances
    num-blocks              the smallest KV pool per instance
    cache-memory-budget     the smallest memory tier (bytes), to within 5%

From the value given on the command line the search doubles until the
target is met (or halves while it still is), then bisects between the last
miss and the first hit; it gives up where three doublings changed nothing
at all in the run (another resource binds). Attainment need not be monotonic in every resource
(a bigger pool admits more at once, which can cost latency), so every value
tried is shown: the curve, not only the answer. With `--runs N` each value
is simulated N times (jittered arrivals) and judged by the run of median
attainment: one run of a short trace is one draw of it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from kvstash.common.units import MIB
from kvstash.workload.metrics import Summary
from kvstash.workload.trace import Trace

# Flag name -> the attribute of the parsed arguments it sets, and its largest value.
DIMENSIONS: dict[str, tuple[str, int]] = {
    "instances": ("instances", 4096),
    "num-blocks": ("num_blocks", 1 << 24),
    "cache-memory-budget": ("host_bytes", 1 << 44),
}


@dataclass(frozen=True, slots=True)
class Found:
    value: int | None  # None: not met even at the largest value tried
    tried: dict[int, Summary]  # every value simulated, and how it did


def search(start: int, largest: int, target: float, run: Callable[[int], Summary],
           close_enough: Callable[[int, int], bool], binds_below: int = 0) -> Found:
    """The least value in [1, largest] whose run meets `target`, assuming a
    miss below and a hit above it; `close_enough(miss, hit)` ends bisection.
    Below `binds_below` the resource is known to bind (a pool that cannot
    hold the longest request): runs alike there do not end the search."""
    tried: dict[int, Summary] = {}

    def meets(value: int) -> bool:
        if value not in tried:
            tried[value] = run(value)
        return tried[value].attainment >= target

    miss, hit = 0, max(1, start)
    if meets(hit):
        while hit > 1 and meets(hit // 2):
            hit //= 2
        miss = hit // 2
    else:
        while not meets(hit):
            miss, hit = hit, hit * 2
            last = [repr(tried[v]) for v in (miss // 4, miss // 2, miss) if v in tried]
            if hit > largest or (miss >= binds_below and len(last) == 3
                                 and len(set(last)) == 1):
                return Found(None, tried)  # beyond the largest, or the runs are all alike
    while miss and not close_enough(miss, hit):
        middle = (miss + hit) // 2
        miss, hit = (miss, middle) if meets(middle) else (middle, hit)
    return Found(hit, tried)


def close_enough(dimension: str) -> Callable[[int, int], bool]:
    if dimension == "cache-memory-budget":
        return lambda miss, hit: hit - miss <= max(MIB, hit // 20)
    return lambda miss, hit: hit - miss <= 1


def plot(found: Found, dimension: str, target: float, path: str, title: str) -> None:
    """Attainment and goodput at every value tried (matplotlib: the bench extra)."""
    from matplotlib.figure import Figure

    values = sorted(found.tried)
    fig = Figure(figsize=(11, 4))
    met, good = fig.subplots(1, 2)
    met.plot(values, [100 * found.tried[v].attainment for v in values], marker="o")
    met.axhline(100 * target, color="grey", linestyle="--", label=f"target {target:.0%}")
    if found.value is not None:
        met.axvline(found.value, color="green", linestyle=":", label=f"found {found.value:,}")
    good.plot(values, [found.tried[v].goodput for v in values], marker="o")
    met.set(xlabel=dimension, ylabel="SLO attainment (%)", ylim=(0, 105), xscale="log")
    good.set(xlabel=dimension, ylabel="goodput (req/s within SLOs)", xscale="log")
    met.legend()
    for ax in (met, good):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def least(args: argparse.Namespace, policy: str, trace: Trace,
          summary: Callable[[], Summary]) -> int:
    """kvstash sim --find, printing the curve: `summary()` simulates the
    setting `args` holds (the dimension's attribute set to each value tried).
    Exit code 0 where met, 1 where not."""
    attr, largest = DIMENSIONS[args.find]
    target = 0.9 if args.target is None else args.target

    def run_at(value: int) -> Summary:
        setattr(args, attr, value)
        result = summary()
        print(f"  {args.find} {value:>14,}: SLO attainment {result.attainment:6.1%}, "
              f"goodput {result.goodput:.3f}/s, TTFT p99 {result.ttft_s['p99']:.3f} s",
              flush=True)
        return result

    runs = f" (the median of {args.runs} runs)" if args.runs > 1 else ""
    print(f"finding the least {args.find} for SLO attainment >= {target:.0%}{runs}: "
          f"{policy}, {len(trace.requests)} requests at {trace.rate:.3g}/s")
    # Pools too small for every request fail them all alike (1, 2, 4 blocks):
    # the pool binds there, however alike the runs.
    longest = max(r.input_length + r.output_length for r in trace.requests)
    binds_below = -(-longest // args.block_size) if args.find == "num-blocks" else 0
    found = search(getattr(args, attr), largest, target, run_at, close_enough(args.find),
                   binds_below)
    if args.plots is not None:
        args.plots.mkdir(parents=True, exist_ok=True)
        plot(found, args.find, target, str(args.plots / "find.png"),
             f"kvstash sim --find {args.find}: {policy} at {trace.rate:.3g} req/s")
    if found.value is None:
        print(f"not met: up to {max(found.tried):,} {args.find} (more stopped helping, or the "
              f"largest searched)")
        return 1
    print(f"least {args.find}: {found.value:,}")
    return 0
