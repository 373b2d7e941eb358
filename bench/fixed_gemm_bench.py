"""fixed_gemm (the GPU's row-invariant matmul) against cuBLAS (`F.linear`) on
Llama-3.2-1B's matmuls, in bf16: TFLOP/s of each at several row counts, and
whether each gives the first 128 rows the same bits at every row count.

Run (a CUDA machine): python -m bench.fixed_gemm_bench [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_worker import fixed_gemm

# (name, in, out, laid out [in, out] as the worker stores weights)
SHAPES = (("qkv", 2048, 3072, True), ("o_proj", 2048, 2048, True),
          ("gate_up", 2048, 16384, True), ("down_proj", 8192, 2048, True),
          ("lm_head (tied)", 2048, 128256, False))
ROWS = (128, 1024, 4096)


def seconds(fn: Callable[[], object], repeat: int = 20) -> float:
    """Median time of one call on the device (CUDA events), after a warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    first = fn(x[:128])
    return all(torch.equal(fn(x[:rows])[:128], first) for rows in (*ROWS, 256, 384, 2048))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    print(f"{'matmul':<15} {'rows':>5} {'cuBLAS TF/s':>12} {'fixed TF/s':>11} {'ratio':>6} "
          f"{'cuBLAS inv':>10} {'fixed inv':>9}")
    for name, k, out, in_out in SHAPES:
        weight = torch.randn(out, k, generator=gen, device="cuda").to(torch.bfloat16)
        if in_out:
            weight = weight.t().contiguous().t()
        x = torch.randn(max(ROWS), k, generator=gen, device="cuda").to(torch.bfloat16)
        def cublas_mm(rows: torch.Tensor, weight: torch.Tensor = weight) -> torch.Tensor:
            return F.linear(rows, weight)

        def fixed_mm(rows: torch.Tensor, weight: torch.Tensor = weight) -> torch.Tensor:
            return fixed_gemm.matmul(rows, weight)

        inv_cublas, inv_fixed = invariant(cublas_mm, x), invariant(fixed_mm, x)
        for rows in ROWS:
            flops = 2 * rows * k * out
            part = x[:rows]
            cublas = flops / seconds(functools.partial(cublas_mm, part)) / 1e12
            fixed = flops / seconds(functools.partial(fixed_mm, part)) / 1e12
            print(f"{name:<15} {rows:>5} {cublas:>12.1f} {fixed:>11.1f} {fixed / cublas:>6.2f} "
                  f"{inv_cublas!s:>10} {inv_fixed!s:>9}")
            results.append({"matmul": name, "in": k, "out": out, "rows": rows,
                            "cublas_tflops": cublas, "fixed_tflops": fixed,
                            "cublas_invariant": inv_cublas, "fixed_invariant": inv_fixed})
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "torch": torch.__version__, "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()
