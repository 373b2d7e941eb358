"""The oracle the worker's one forward path (the batched step) is checked against.

Two independent computations of the same model, over the weights of a
`gpu_worker.model.CausalLM`, that product code never runs:

- `reference_forward`: a whole sequence from position 0, no cache, through
  torch's own causal attention kernel (checks paging and the batched path);
- `forward_paged` / `forward` / `execute_per_sequence`: one sequence per call
  over the paged cache, one forward and one host sync each (checks that
  packing a step changes nothing: same tokens as the batched runner, and in
  float64 the same function). `sample` is its per-row sampling and
  `filtered_probs` one row's distribution.

Paging, as the worker's cache tensor [L, 2, num_blocks, block_size, heads, dim]:

    position p -> block_table[p // block_size], offset p % block_size

    positions  0 ............ start_pos ............ start_pos+n-1
               [ already in the cache ][ written by this call  ]
               [ read by attention (causal: query i sees keys <= its position) ]

Also imported by bench/worker_bench.py for its `per-seq` mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.model import Attention, CausalLM, DecoderLayer, apply_rotary, compute_dtype
from gpu_worker.runner import ModelRunner, SeqWork
from gpu_worker.sampling import (
    SamplingBatch,
    SamplingParams,
    filtered_rows,
    sample_rows,
    to_device,
)


@dataclass(slots=True)
class PagedKv:
    """One layer's view of the paged cache for one sequence."""

    cache: torch.Tensor  # [2, num_blocks * block_size, num_kv_heads, head_dim]
    write_slots: torch.Tensor  # slot of each new token, [n]
    read_slots: torch.Tensor  # slot of every position 0..last, [start_pos + n]


def _masked(attn: Attention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            positions: torch.Tensor) -> torch.Tensor:
    """q: [n, heads, d]; keys/values: [T, kv_heads, d] for positions 0..T-1."""
    n, group = q.shape[0], attn.num_heads // attn.num_kv_heads
    acc = compute_dtype(q.dtype)
    qg = q.view(n, attn.num_kv_heads, group, attn.head_dim).permute(1, 2, 0, 3).to(acc)
    kt = keys.permute(1, 2, 0).unsqueeze(1).to(acc)  # [kv_heads, 1, d, T]
    scores = (qg @ kt) * (1.0 / math.sqrt(attn.head_dim))  # [kv_heads, group, n, T]
    key_pos = torch.arange(keys.shape[0], device=q.device)
    scores = scores.masked_fill(key_pos[None, :] > positions[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs @ values.permute(1, 0, 2).unsqueeze(1).to(acc)  # [kv_heads, group, n, d]
    return out.permute(2, 0, 1, 3).to(q.dtype)


def _full_causal(attn: Attention, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
    """Ordinary causal attention over this call's tokens only, through torch's
    own kernel, so that it checks the paged paths independently."""
    group = attn.num_heads // attn.num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


def _attention(attn: Attention, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, paged: PagedKv | None) -> torch.Tensor:
    n = x.shape[0]
    q = attn.q_proj(x).view(n, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(n, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(n, attn.num_kv_heads, attn.head_dim)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if paged is None:
        out = _full_causal(attn, q, k, v)
    else:
        paged.cache[0].index_copy_(0, paged.write_slots, k)
        paged.cache[1].index_copy_(0, paged.write_slots, v)
        keys = paged.cache[0].index_select(0, paged.read_slots)
        values = paged.cache[1].index_select(0, paged.read_slots)
        out = _masked(attn, q, keys, values, positions)
    return attn.o_proj(out.reshape(n, attn.num_heads * attn.head_dim))


def _run(model: CausalLM, token_ids: torch.Tensor, positions: torch.Tensor,
         paged_for_layer: list[PagedKv] | None, all_logits: bool) -> torch.Tensor:
    x = model.model.embed_tokens(token_ids)
    cos, sin = model.rotary(positions)
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, DecoderLayer)
        paged = None if paged_for_layer is None else paged_for_layer[i]
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), positions, cos, sin, paged)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = x if all_logits else x[-1:]
    logits = model.lm_head(model.model.norm(x))
    return logits if all_logits else logits[0]


@torch.inference_mode()
def reference_forward(model: CausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """Logits [n, vocab] for a whole sequence from position 0, no cache."""
    positions = torch.arange(token_ids.shape[0], device=model.device)
    return _run(model, token_ids.to(model.device), positions, None, all_logits=True)


@torch.inference_mode()
def forward_paged(model: CausalLM, token_ids: torch.Tensor, start_pos: int,
                  kv_cache: torch.Tensor, block_table: torch.Tensor,
                  all_logits: bool = False) -> torch.Tensor:
    """Computes tokens at positions start_pos..start_pos+n-1, writes their K/V
    into the blocks of `block_table` and attends over every cached position.
    Returns the last token's logits [vocab], or [n, vocab] with all_logits.
    Inputs are trusted."""
    num_layers, _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    n = token_ids.shape[0]
    end = start_pos + n
    all_pos = torch.arange(end, device=model.device)
    slots = block_table[all_pos // block_size] * block_size + all_pos % block_size
    flat = kv_cache.view(num_layers, 2, num_blocks * block_size, kv_heads, head_dim)
    paged = [PagedKv(flat[i], slots[start_pos:], slots) for i in range(num_layers)]
    return _run(model, token_ids, all_pos[start_pos:], paged, all_logits)


def forward(runner: ModelRunner, seq: SeqWork, all_logits: bool = False) -> torch.Tensor:
    """`forward_paged` of one sequence on `runner`'s model and KV cache (its KV is
    written): logits after the last token ([vocab]) or for every token ([n, vocab])."""
    tokens = torch.tensor(list(seq.token_ids), dtype=torch.long, device=runner.device)
    table = torch.tensor(list(seq.block_ids), dtype=torch.long, device=runner.device)
    return forward_paged(runner.model, tokens, seq.start_pos, runner.kv_cache, table, all_logits)


def execute_per_sequence(runner: ModelRunner, seqs: Sequence[SeqWork],
                         process_gen: torch.Generator | None = None) -> list[int | None]:
    """`runner.execute`, one forward and one sync per sequence: the sampled token
    per sequence (None where sample is unset). Validated as `execute` does."""
    runner.check_step(seqs)
    gen = process_gen if process_gen is not None else torch.Generator().manual_seed(0)
    out: list[int | None] = []
    for seq in seqs:
        logits = forward(runner, seq)
        position = seq.start_pos + len(seq.token_ids)
        out.append(sample(logits, seq.sampling, position, gen) if seq.sample else None)
    return out


def sample(logits: torch.Tensor, params: SamplingParams, position: int,
           process_gen: torch.Generator) -> int:
    """The token to place at `position`, given the logits [vocab] that predict it
    (one row, one host sync), through the batched sampler."""
    batch = SamplingBatch.build([params], [position], process_gen)
    return int(sample_rows(logits[None], to_device(batch, logits.device), None)[0])


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [vocab] (float64) of one row after temperature, top-k and
    top-p; filtered-out tokens get exactly 0."""
    batch = SamplingBatch.build([params], [0], torch.Generator())
    s = to_device(batch, logits.device)
    return filtered_rows(logits[None], s, batch.any_filter)[0]
