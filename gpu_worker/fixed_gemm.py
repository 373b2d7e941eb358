"""A matmul whose rows' bits do not depend on how many rows it multiplies, on
GPUs (Triton), so batch-invariant steps can run whole there (batched.py).

cuBLAS picks its kernel, the kernel's tile and whether to split K from the
problem's shape, so a row multiplied among 1,024 rows can get other bits than
among 128: invariant steps on a GPU therefore ran tile by tile, one launch per
op per 128 rows (a 1,024-token chunk: 8 of each). This kernel has one tile
shape per dtype, never splits K, and walks it in order:

    C[m, n] = (...((A[m, k0] . B[k0, n]) + A[m, k1] . B[k1, n]) + ...)
              k-blocks of block_k, in order, accumulated in float32

Which other rows share the tile, and how many tiles there are, changes which
program computes a row, never its arithmetic: one launch, any row count.
Float32 multiplies in IEEE float32 as torch does by default (not TF32).

`TRITON_INTERPRET=1` (set before triton is imported) runs the same kernel on
CPU tensors, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

# One tile shape per dtype and device kind, never chosen from the row count
# (that would undo the point). 16-bit: 128 x 128 x 64 in 3 stages (96 KiB of
# shared memory: any sm80+ GPU); on Hopper, whose SMs hold 228 KiB, 128 x 256
# x 64 in 4 stages: on an H100 at Llama-3.2-1B's five matmuls, 1.10-1.25x the
# smaller tile's FLOP/s at 4,096 rows (a prefill step holds up to 8,192),
# 0.87-1.19x at 1,024 (a sweep of 8 tiles, 2026-11-27).
_TILE_16 = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}
_TILE_16_HOPPER = {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8,
                   "num_stages": 4}
_TILE_32 = {"block_m": 64, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 3}
_CONFIGS: dict[torch.dtype, dict[str, Any]] = {
    torch.bfloat16: _TILE_16, torch.float16: _TILE_16, torch.float32: _TILE_32,
}
_GROUP_M = 8  # tiles of C walked in groups of 8 rows of tiles: B stays in L2


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `matmul` runs here: Triton installed and a CUDA device (or the
    interpreter), in a dtype it has a tile for."""
    if dtype not in _CONFIGS:
        return False
    if device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, K] . weight^T, weight [out, K] in any layout: [rows, out] in
    x's dtype, each row's bits independent of `rows`."""
    rows, k = x.shape
    out_features = weight.shape[0]
    b = weight.t()  # [K, out], strided as it lies
    c = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    config = _CONFIGS[x.dtype]
    if config is _TILE_16 and x.is_cuda and _hopper(x.device.index):
        config = _TILE_16_HOPPER
    kernel = _kernel()

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (-(-rows // meta["block_m"]) * -(-out_features // meta["block_n"]),)

    kernel[grid](x, b, c, rows, out_features, x.stride(0), x.stride(1), b.stride(0),
                 b.stride(1), c.stride(0), k=k, group_m=_GROUP_M,
                 ieee=x.dtype == torch.float32, **config)
    return c


@functools.cache
def _hopper(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, defined on first use (the module imports without triton)."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def fixed_tile_gemm(a_ptr, b_ptr, c_ptr, m, n, stride_am, stride_ak,  # type: ignore[no-untyped-def]
                        stride_bk, stride_bn, stride_cm, k: tl.constexpr,
                        block_m: tl.constexpr, block_n: tl.constexpr, block_k: tl.constexpr,
                        group_m: tl.constexpr, ieee: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(m, block_m)
        tiles_n = tl.cdiv(n, block_n)
        in_group = pid % (group_m * tiles_n)
        first_m = pid // (group_m * tiles_n) * group_m
        group_rows = tl.minimum(tiles_m - first_m, group_m)
        rm = (first_m + in_group % group_rows) * block_m + tl.arange(0, block_m)
        rn = in_group // group_rows * block_n + tl.arange(0, block_n)
        rk = tl.arange(0, block_k)
        a = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
        b = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros((block_m, block_n), dtype=tl.float32)
        for block in range(0, (k + block_k - 1) // block_k):
            k_left = k - block * block_k
            tile_a = tl.load(a, mask=(rm[:, None] < m) & (rk[None, :] < k_left), other=0.0)
            tile_b = tl.load(b, mask=(rk[:, None] < k_left) & (rn[None, :] < n), other=0.0)
            if ieee:
                acc = tl.dot(tile_a, tile_b, acc, input_precision="ieee")
            else:
                acc = tl.dot(tile_a, tile_b, acc)
            a += block_k * stride_ak
            b += block_k * stride_bk
        c = c_ptr + rm[:, None] * stride_cm + rn[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < m) & (rn[None, :] < n))

    return fixed_tile_gemm
