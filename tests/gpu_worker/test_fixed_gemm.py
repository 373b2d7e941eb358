"""fixed_gemm, the GPU's row-invariant matmul, run here by Triton's
interpreter on CPU tensors (in a process of its own: the interpreter is
chosen when triton is imported). Float32 and float16: the interpreter
multiplies bfloat16 tiles as integers, so bf16 is checked on a GPU
(test_worker_gpu.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from gpu_worker import fixed_gemm
from tests.gpu_worker.worker_factories import REPO

SCRIPT = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
import torch.nn.functional as F
from gpu_worker import fixed_gemm
from gpu_worker.products import linear, stored_transposed

gen = torch.Generator().manual_seed(0)
cpu = torch.device("cpu")
# Sizes that are no multiple of any tile: edges masked in all three dimensions.
rows, k, out = 333, 300, 200
for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
    assert fixed_gemm.available(cpu, dtype)
    in_out = stored_transposed(out, k, dtype, cpu)
    in_out.copy_(torch.randn(out, k, generator=gen))
    for weight in (in_out, torch.randn(out, k, generator=gen).to(dtype)):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        product = fixed_gemm.matmul(x, weight)
        exact = x.double() @ weight.double().t()
        error = ((product.double() - exact).abs().max() / exact.abs().max()).item()
        assert error < tol, (dtype, error)
        for first in (1, 5, 64, 128, 130):
            assert torch.equal(fixed_gemm.matmul(x[:first], weight), product[:first]), first
        bias = torch.randn(out, generator=gen).to(dtype)
        batched = x[:6].view(2, 3, k)
        got = linear(batched, weight, bias, fixed_gemm.matmul)
        assert got.shape == (2, 3, out)
        assert torch.allclose(got.float(), F.linear(batched.float(), weight.float(),
                                                    bias.float()), atol=tol * 30), dtype

print("ok")
"""

# A whole step as a GPU runs it (128-row pads, every matmul in fixed_gemm)
# passes the runner's start-up check.
WHOLE_STEP = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from gpu_worker import fixed_gemm
from gpu_worker.batched import BatchedForward
from gpu_worker.config import tiny_model_config
from gpu_worker.invariance import rows_match_alone
from gpu_worker.model import build_tiny_model
model = build_tiny_model(tiny_model_config(), seed=0, dtype=torch.float32, device="cpu")
whole = BatchedForward(model, 16, 1024, 128, True)
whole.matmul = fixed_gemm.matmul
assert rows_match_alone(whole, 16)
print("ok")
"""


def run(script: str) -> None:
    done = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning", "-c", script],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "ok"


def host_dot_keeps_a_rows_bits_wherever_it_sits() -> bool:
    """The interpreter multiplies a tile with numpy's matmul (this host's
    BLAS). Where that gives a row other bits by its place in the tile (seen
    on an AMD EPYC host, not on an AVX-512 Xeon), a row moved within its tile
    changes bits however the kernel is written: a GPU's tile multiply gives
    none."""
    gen = np.random.default_rng(0)
    a = gen.standard_normal((64, 32)).astype(np.float32)
    b = gen.standard_normal((32, 64)).astype(np.float32)
    return all(np.array_equal(np.roll(np.roll(a, s, axis=0) @ b, -s, axis=0), a @ b)
               for s in (1, 7, 33))


def test_the_kernel_multiplies_and_a_row_bits_do_not_depend_on_the_row_count() -> None:
    """Against float64 to the dtype's rounding, in both weight layouts; each
    row bit for bit the same whether 1, 5, 64, 128, 130 or 333 rows are
    multiplied (the tile is 64 or 128 rows); through products.linear with a
    bias and leading dimensions."""
    run(SCRIPT)


def test_a_whole_step_in_the_kernel_passes_the_start_up_check() -> None:
    """invariance.rows_match_alone: rows alone sit elsewhere in their tiles
    than together, which only a host whose own tile multiply ignores a row's
    place can emulate (the GPU check: test_worker_gpu.py)."""
    if not host_dot_keeps_a_rows_bits_wherever_it_sits():
        pytest.skip("this host's BLAS gives a row other bits by its place in a tile: "
                    "the interpreter cannot emulate the GPU's tile multiply here")
    run(WHOLE_STEP)


def test_it_is_offered_only_where_it_runs() -> None:
    """Not on a CPU without the interpreter (whole CPU steps use k_pieces),
    not for a dtype without a tile, and a whole GPU step without it is refused."""
    cpu = torch.device("cpu")
    assert not fixed_gemm.available(cpu, torch.float32)
    assert not fixed_gemm.available(torch.device("cuda"), torch.float64)
    from gpu_worker.batched import invariant_matmul
    from gpu_worker.products import k_pieces
    assert invariant_matmul(cpu, torch.float32) is k_pieces
    with pytest.raises(ValueError, match="Triton"):
        invariant_matmul(torch.device("cuda"), torch.float64)
