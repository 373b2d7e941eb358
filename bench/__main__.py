"""`make bench`: every benchmark in turn, each printing its own table."""

from __future__ import annotations

import importlib

BENCHMARKS = ("bench.scheduler_bench", "bench.cache_bench", "bench.arena_bench",
              "bench.kv_transfer_bench", "bench.offload_bench", "bench.offload_vs_recompute",
              "bench.worker_bench")


def main() -> None:
    for name in BENCHMARKS:
        print(f"\n=== {name} ===", flush=True)
        importlib.import_module(name).main()


if __name__ == "__main__":
    main()
