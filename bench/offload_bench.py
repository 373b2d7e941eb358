"""Offload vs recompute under KV-memory pressure, side by side in one run: the
trace replayer (bench.replay) on a burst that a small KV pool cannot hold.

48 synthetic requests arrive within about a second (prompts log-normal around
256 tokens, outputs around 192, nothing shared), on a pool of 96 blocks: a
small fraction of what they ask for. Each policy gets a fresh stack: the two
preemption modes and AUTO under the default `new_token_ratio` reservation,
and the two modes again under the optimistic fixed-blocks reservation, which
preempts more. The replayer's table follows (preemptions by mode, tokens
recomputed, MiB offloaded), and its oracle fails the run unless every
output is the same under every policy.

    python -m bench.offload_bench                        # the tiny model
    python -m bench.offload_bench --model llama-small    # recompute costs more

Any other bench.replay flag given overrides the preset's (but --trace: the
preset's workload is --synthetic).
"""

from __future__ import annotations

import sys

from bench.replay.__main__ import main as replay

PRESET = ("--synthetic", "48", "--synthetic-input", "256", "--synthetic-output", "192",
          "--synthetic-shared-blocks", "0", "--rates", "50", "--num-blocks", "96",
          "--policies", "recompute,offload,auto,recompute-fixed,offload-fixed",
          "--out", "bench-results/offload")


def main(argv: list[str] | None = None) -> int:
    return replay([*PRESET, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
