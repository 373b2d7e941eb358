"""The products of a layer's weights with its rows: x [rows, in] . W^T.

`linear` is the one form every caller uses; with a `Matmul` it becomes one
whose rows' bits do not depend on the row count (whole batch-invariant
steps, batched.py): `k_pieces` on the CPU, `fixed_gemm.matmul` on GPUs.
`product_of` settles what such a product asks of its weight once, for the
step's hot loop. Weights lie [in, out] in memory (`stored_transposed`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def stored_transposed(out_features: int, in_features: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """An [out, in] weight laid out [in, out] in memory: `F.linear` then hands
    the BLAS a plain (untransposed) matrix, which MKL multiplies 10-25% faster
    on CPU (bench.worker_bench); checkpoints load into it as they are."""
    return torch.empty(in_features, out_features, dtype=dtype, device=device).t()


# x [rows, K] . weight^T, weight [out, K]: a product whose rows' bits do not
# depend on the row count (whole batch-invariant steps, batched.py).
Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
K_PIECE = 512  # see k_pieces


def k_pieces(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The CPU's invariant product, on the BLAS we have measured
    (invariance.py checks it at start): the inner dimension in fixed pieces
    of `K_PIECE` columns, summed in order (one mm, then addmm), because MKL
    splits a long K into blocks whose size follows the row count (AVX-512:
    from K = 1024, a row gets other bits from 20 rows):

        x [rows, K] . W^T = x[:, 0:p] W^T[0:p] + x[:, p:2p] W^T[p:2p] + ...

    A weight laid out [in, out] (stored_transposed) is multiplied as it lies;
    one laid out [out, in] (a tied output head: the embedding) as
    (W . x^T)^T, with the rows as the product's columns: x . W^T with W^T a
    transposed view gives a row other bits from 8-16 rows. (GPUs: fixed_gemm.)"""
    if weight.t().is_contiguous():
        return _sum_pieces(x, _cut(weight.t()))
    return _sum_pieces(weight, _cut(x.t())).t()


def _cut(b: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """b [K, n] in pieces of K_PIECE rows: (first row, piece)."""
    return [(start, b[start:start + K_PIECE]) for start in range(0, b.shape[0], K_PIECE)]


def _sum_pieces(a: torch.Tensor, pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """a . b, b cut by `_cut`: one mm, then one addmm per further piece."""
    out = torch.mm(a[:, :K_PIECE], pieces[0][1])
    for start, piece in pieces[1:]:
        out = torch.addmm(out, a[:, start:start + K_PIECE], piece)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           matmul: Matmul | None = None) -> torch.Tensor:
    """`F.linear`, or with `matmul` (k_pieces, fixed_gemm.matmul) a form whose
    rows' bits do not depend on the row count."""
    if matmul is None:
        return F.linear(x, weight, bias)
    out = matmul(x.reshape(-1, weight.shape[1]), weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


# A product with one weight: x [rows, in] -> [rows, out].
Product = Callable[[torch.Tensor], torch.Tensor]


def product_of(weight: torch.Tensor, bias: torch.Tensor | None, matmul: Matmul | None) -> Product:
    """`linear(x, weight, bias, matmul)` for rows x [rows, in], with what it
    asks of the weight (its layout, its pieces) settled once, not on every
    call: on the CPU a lone decode's step spent more in that Python than in
    its products."""
    if matmul is k_pieces and weight.t().is_contiguous():
        pieces = _cut(weight.t())
        if bias is None:
            return lambda x: _sum_pieces(x, pieces)
        return lambda x: _sum_pieces(x, pieces) + bias
    if matmul is None:
        return lambda x: F.linear(x, weight, bias)
    return lambda x: linear(x, weight, bias, matmul)
