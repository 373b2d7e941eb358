"""exp and silu whose result for an element does not depend on the size of the
tensor around it (CPU), for whole steps (batched.py).

torch runs an element-wise op over a contiguous range two vectors at a time
and does the last `range mod span` elements with scalar code; for exp and
silu the two differ in the last bit on some inputs (Sleef vs libm). Past
32,768 elements it also cuts the range among threads, anywhere. So over a
whole step an element's bits would depend on the step's size and the thread
count:

    range   [ vector | vector | vector | ... | vector | scalar tail ]
    here    [ row | row | ... | row ]  one call per piece of whole rows,
            at most 32,768 elements (one thread), rows a multiple of the span

Every element then takes the vector path. With at most two threads one call
does: torch cuts a range into at most two halves (`divup(n, 2)`, OpenMP's
at::parallel_for), which fall between rows when the rows are even in number.
Add, multiply, divide, sqrt and max round the same either way (IEEE), so the
other ops need none of this.

Measured on an AVX-512 host with MKL (2026-11-27): silu gives an element
other bits by where its range starts and ends; exp, which torch hands to
MKL's vector math there (its own grain, 2,048 elements), gave the same bits
at every offset and length tried. exp keeps the guard for builds whose exp
has a scalar tail; where more than two threads cut a piece of it, that
measurement is what keeps its elements' bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ONE_THREAD = 32768  # torch's grain: an element-wise op over fewer runs on one thread


def span(dtype: torch.dtype) -> int:
    """Elements torch's vector body takes per iteration (two vectors) on this CPU."""
    vector_bytes = 64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32
    return 2 * vector_bytes // dtype.itemsize


def whole_rows_(op_: Callable[[torch.Tensor], object], x: torch.Tensor) -> torch.Tensor:
    """op_ in place on contiguous `x` [..., width], width a multiple of `span`."""
    if x.device.type != "cpu":
        op_(x)
        return x
    flat = x.view(-1, x.shape[-1])
    if torch.get_num_threads() <= 2 and flat.shape[0] % 2 == 0:
        op_(flat)  # one cut at most, between rows
        return x
    for piece in flat.split(max(1, ONE_THREAD // flat.shape[1])):
        op_(piece)
    return x


def exp_(x: torch.Tensor) -> torch.Tensor:
    """In place; `x` contiguous, its last dimension a multiple of `span`."""
    return whole_rows_(torch.exp_, x)


def silu_(x: torch.Tensor) -> torch.Tensor:
    """In place; `x` contiguous, its last dimension a multiple of `span`."""
    return whole_rows_(lambda piece: F.silu(piece, inplace=True), x)
