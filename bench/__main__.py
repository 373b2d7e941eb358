"""`make bench`: every benchmark in turn, each printing its own table. A
benchmark whose main() returns non-zero (its check failed), exits so or
raises fails the run; the others still run."""

from __future__ import annotations

import importlib
import sys
import traceback

BENCHMARKS = ("bench.scheduler_bench", "bench.cache_bench", "bench.arena_bench",
              "bench.kv_transfer_bench", "bench.offload_bench", "bench.offload_vs_recompute",
              "bench.worker_bench", "bench.pd_bench", "bench.gateway_bench")


def main() -> int:
    failed = []
    for name in BENCHMARKS:
        print(f"\n=== {name} ===", flush=True)
        try:
            code = importlib.import_module(name).main()
        except SystemExit as exc:
            code = exc.code
        except Exception:  # one broken benchmark must not cost the others' figures
            traceback.print_exc()
            code = 1
        if code:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
