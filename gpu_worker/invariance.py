"""The start-up check behind whole steps (batched.py): on this machine's BLAS,
does a row get the same bits whatever the size of the step around it?

It runs the model's first layer and its output head over a few steps, each
row against its sequence run alone in a step of its own, and each decode row
against the same token as the last row of a prefill (a recomputed token):

    together  [ 1 | 3 | 17 | 40 | 150 | 300 ] prefill rows   then  [ 6 decodes ]
    alone     [ 1 ] [ 3 ] [ 17 ] [ 40 ] [ 150 ] [ 300 ]              [ 1 ] x 6
    recompute                          [ 2 ] [ 4 ] [ 18 ] [ 41 ] [ 151 ] [ 301 ]

Row counts from 4 to 512 (the scheduler's default step budget; fewer where
max_model_len is shorter), contexts of up to three 128-key chunks, both
query tile sizes, on scratch caches (the runner's own blocks are not
touched); on a GPU also a prompt of 600 tokens, so that a step spans several
of its 128-row pads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_worker import fixed_gemm
from gpu_worker.attention import AttentionBackend
from gpu_worker.batched import BatchedForward, default_row_tile
from gpu_worker.model import CausalLM
from gpu_worker.query_tiles import GEMM_ROW_PANEL
from gpu_worker.sampling import GREEDY, SamplingParams
from gpu_worker.step_inputs import StepStaging, pack_step

CHECK_LENGTHS = (1, 3, 17, 40, 150, 300)
GPU_CHECK_LENGTHS = (*CHECK_LENGTHS, 600)
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Seq:  # a step_inputs.StepSeq
    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[int]
    sample: bool = False
    sampling: SamplingParams = GREEDY


def rows_match_alone(forward: BatchedForward, block_size: int, seed: int = 0) -> bool:
    model, row_tile = forward.model, forward.row_tile
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    longest = len(forward.cos) - 1  # the decode after it must fit too
    lengths = [max(1, min(n, longest))
               for n in (CHECK_LENGTHS if model.device.type == "cpu" else GPU_CHECK_LENGTHS)]
    per_seq = -(-(max(lengths) + 1) // block_size)
    shape = (1, 2, per_seq * len(lengths), block_size, cfg.num_kv_heads, cfg.head_dim)
    together, alone = (torch.zeros(shape, dtype=model.dtype, device=model.device)
                       for _ in range(2))
    staging = StepStaging(model.device)

    def run(seqs: list[_Seq], cache: torch.Tensor) -> torch.Tensor:
        """Logits of every real row."""
        host = pack_step(seqs, block_size, row_tile, gen)
        hidden = forward.hidden(staging.stage(host), cache)
        return forward.logits(hidden)[:host.num_tokens]

    prefill = [_Seq(torch.randint(cfg.vocab_size, (n,), generator=gen).tolist(), 0,
                    range(i * per_seq, (i + 1) * per_seq))
               for i, n in enumerate(lengths)]
    decode = [_Seq([int(seq.token_ids[0])], len(seq.token_ids), seq.block_ids)
              for seq in prefill]
    for step in (prefill, decode) if longest else (prefill,):  # max_model_len 1: no decodes
        rows = run(step, together)
        start = 0
        for seq in step:
            n = len(seq.token_ids)
            if not torch.equal(rows[start:start + n], run([seq], alone)):
                return False
            start += n
    if not longest:
        return True
    # `rows` now holds the decodes' logits; each prefill again, one token longer.
    for i, (seq, token) in enumerate(zip(prefill, decode, strict=True)):
        again = _Seq([*seq.token_ids, *token.token_ids], 0, seq.block_ids)
        if not torch.equal(run([again], alone)[-1], rows[i]):
            return False
    return True


def choose_forward(model: CausalLM, block_size: int, max_model_len: int, batch_invariant: bool,
                   row_tile: int | None, attention: AttentionBackend | None) -> BatchedForward:
    """Whole steps where this check passes (on a GPU: where Triton runs
    `fixed_gemm`); tiles where a row tile is asked for, and elsewhere."""
    def forward(tile: int | None, whole: bool) -> BatchedForward:
        return BatchedForward(model, block_size, max_model_len, tile, whole, attention)

    if not batch_invariant:
        return forward(None, True)
    tiles = row_tile or default_row_tile(model.device)
    cpu = model.device.type == "cpu"
    if row_tile is not None or not (cpu or fixed_gemm.available(model.device, model.dtype)):
        return forward(tiles, False)
    whole = forward(GEMM_ROW_PANEL if cpu else tiles, True)
    if rows_match_alone(whole, block_size):
        return whole
    log.warning("on this %s a row's numbers change with the size of its step: "
                "batch-invariant steps run tile by tile, slower",
                "CPU's BLAS" if cpu else "GPU (fixed_gemm)")
    return forward(tiles, False)
