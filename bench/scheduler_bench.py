"""Per-step cost of Scheduler.schedule() + update() with N running decode requests.

    python -m bench.scheduler_bench

The cost must grow with the number of running requests, not with the pool:
the last rows keep 1024 requests and change only num_blocks.
"""

from __future__ import annotations

import gc
import statistics
import time

from scheduler_svc.config import ReservationPolicy, SchedulerConfig
from scheduler_svc.request import SamplingParams
from scheduler_svc.scheduler import Scheduler

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


def main() -> None:
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
