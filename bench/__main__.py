"""`make bench`: every benchmark in turn, each printing its own table. A
benchmark whose main() returns non-zero (its check failed) fails the run."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ("bench.scheduler_bench", "bench.cache_bench", "bench.arena_bench",
              "bench.kv_transfer_bench", "bench.offload_bench", "bench.offload_vs_recompute",
              "bench.worker_bench", "bench.pd_bench", "bench.gateway_bench")


def main() -> int:
    failed = []
    for name in BENCHMARKS:
        print(f"\n=== {name} ===", flush=True)
        if importlib.import_module(name).main():
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
