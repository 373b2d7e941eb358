"""Per-step cost of Scheduler.schedule() + update() with N running decode requests.

    python -m bench.scheduler_bench
    python -m bench.scheduler_bench --compare REV   # this tree vs git revision REV

The cost must grow with the number of running requests, not with the pool:
the last rows keep 1024 requests and change only num_blocks. `--compare`
runs 1024 requests in this tree and in a worktree of REV, alternating, each
round in a fresh process, so both see the same machine noise.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstash.common.sampling import SamplingParams
from scheduler_svc.core.config import ReservationPolicy, SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler

BLOCK_SIZE = 16
PROMPT_LEN = 16
MAX_TOKENS = 1000
NUM_STEPS = 200


def bench_decode(num_requests: int, num_blocks: int, num_steps: int = NUM_STEPS) -> list[float]:
    """Seconds per step for schedule() + update(), all requests decoding."""
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        vocab_size=32000,
        max_num_seqs=num_requests,
        max_num_waiting=num_requests,
        max_num_batched_tokens=num_requests * (PROMPT_LEN + BLOCK_SIZE),
        # The steady state is under test, not admission: reserve nothing.
        reservation_policy=ReservationPolicy.FIXED_BLOCKS,
        fixed_blocks_per_decode=0,
    )
    scheduler = Scheduler(config)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(num_requests):
        # Distinct prompts (no prefix sharing) of staggered lengths, so block
        # boundaries are crossed by 1/BLOCK_SIZE of the requests each step.
        prompt = [(i * 7 + j) % 32000 for j in range(PROMPT_LEN + i % BLOCK_SIZE)]
        scheduler.add_request(f"req-{i}", prompt, sampling)
    sampled = {f"req-{i}": 1 for i in range(num_requests)}
    output = scheduler.schedule()  # the whole prefill in one step
    scheduler.update(output, sampled)
    assert scheduler.stats().num_running_decode == num_requests
    # Each step allocates thousands of short-lived objects, so the collector
    # runs several times per step and would otherwise rescan everything built
    # above. The engine does the same after start-up (gc.freeze() once its
    # imports and model are loaded); collections still run, over young objects.
    gc.collect()
    gc.freeze()
    times = []
    perf_counter = time.perf_counter
    try:
        for _ in range(num_steps):
            start = perf_counter()
            output = scheduler.schedule()
            scheduler.update(output, sampled)
            times.append(perf_counter() - start)
    finally:
        gc.unfreeze()
    assert len(output.seqs) == num_requests
    scheduler.check_integrity()
    return times


_ROUND = (
    "import json, statistics\n"
    "from bench.scheduler_bench import bench_decode\n"
    "print(json.dumps(statistics.fmean(bench_decode(1024, 65536))))\n"
)


def _one_round(tree: Path) -> float:
    """Mean seconds per step at 1024 requests, measured by `tree`'s own code."""
    result = subprocess.run([sys.executable, "-c", _ROUND], cwd=tree, check=True,
                            capture_output=True, text=True, env={"PYTHONPATH": str(tree)})
    return float(json.loads(result.stdout))


def compare(rev: str, rounds: int) -> None:
    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), rev],
                       cwd=here, check=True)
        try:
            times: dict[str, list[float]] = {rev: [], "this tree": []}
            for _ in range(rounds):
                times[rev].append(_one_round(base))
                times["this tree"].append(_one_round(here))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=here,
                           check=True)
    print(f"schedule()+update(), 1024 decoding requests, {NUM_STEPS} steps x {rounds} rounds")
    # Noise on a shared machine only ever adds time, and it comes in phases that
    # slow a whole process: the fastest round is the truest figure, the median
    # says how often noise hit.
    for name, t in times.items():
        print(f"{name:>12}: best {min(t) * 1e3:.3f}, median {statistics.median(t) * 1e3:.3f} "
              f"ms/step (rounds: {', '.join(f'{x * 1e3:.3f}' for x in t)})")
    print(f"this tree / {rev}: best {min(times['this tree']) / min(times[rev]):.2f}, median "
          f"{statistics.median(times['this tree']) / statistics.median(times[rev]):.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scheduler_bench")
    parser.add_argument("--compare", metavar="REV", help="also time git revision REV")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if args.compare:
        compare(args.compare, args.rounds)
        return
    cases = [(n, 65536) for n in (64, 256, 1024, 4096)]
    cases += [(1024, 16384), (1024, 262144)]
    print(f"schedule()+update(), {NUM_STEPS} decode steps, block_size {BLOCK_SIZE}")
    print(f"{'requests':>9} {'blocks':>8} {'mean ms':>9} {'p50 ms':>8} {'p99 ms':>8} {'us/req':>7}")
    for num_requests, num_blocks in cases:
        times = sorted(bench_decode(num_requests, num_blocks))
        mean = statistics.fmean(times)
        p50 = times[len(times) // 2]
        p99 = times[int(len(times) * 0.99)]
        print(
            f"{num_requests:>9} {num_blocks:>8} {mean * 1e3:>9.3f} {p50 * 1e3:>8.3f} "
            f"{p99 * 1e3:>8.3f} {mean / num_requests * 1e6:>7.2f}"
        )


if __name__ == "__main__":
    main()
