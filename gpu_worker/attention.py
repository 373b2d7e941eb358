"""Paged attention for a packed step: every query row attends to the keys of its
own sequence, positions 0..its own, read from the paged cache through the
sequence's block table.

Two implementations, one contract (`PagedAttention.__call__`):

- `flash`: torch's FlashAttention varlen kernel (`torch.nn.attention.varlen`),
  CUDA, fp16/bf16. Each sequence's keys are first gathered from their blocks
  into one packed tensor (FlashAttention-2 reads paged caches only with blocks
  of 256 tokens). `num_splits=1` when batch invariance is asked for: the kernel
  then never splits a row's keys across thread blocks, so a row's reduction
  order depends on its own length only. Older torch lacks some of the
  kernel's keywords (`varlen_options`): grouped K/V heads are then repeated,
  and where it can neither take `num_splits` nor an explicit causal window
  (which keeps the kernel off its split-KV path), batch invariance takes the
  torch path.
- `torch`: plain torch, any device and dtype, the CPU path. Each sequence's
  query rows go in tiles of that sequence (`query_tiles.py`), its keys in
  chunks of `kv_chunk` positions from 0. Every (tile, chunk) pair the tiles
  need is one matrix product, all pairs of a step at once:

      keys of a sequence:  [0 .. C-1][C .. 2C-1] ... [jC .. (j+1)C-1]
      pair (tile, j):      scores = [tile rows x d] x [d x C] (+ mask where needed)
      per row:             max over all its pairs' scores (exact in any order)
      pair (tile, j):      w = exp(scores - row max); w x V, and w's row sums
      per tile:            pairs added in chunk order, values / weight sum
                           (CPU: one index_add_, which adds in index order;
                           elsewhere one per chunk, a pair per tile each)

  A row's numbers depend only on its own keys: chunks past its position add
  exactly 0, and each matmul has the shape of its pair whatever the step,
  given a matmul that gives a row the same bits at every row count the tiles
  use (`QueryTiles`; checked at start, invariance.py). The number of ops per
  layer does not grow with the context.
"""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_worker import elementwise
from gpu_worker.model import compute_dtype
from gpu_worker.query_tiles import QueryTiles, TileGroup, plan_tiles
from gpu_worker.step_inputs import DeviceStep


class AttentionBackend(enum.Enum):
    TORCH = "torch"  # plain torch, any device and dtype
    FLASH = "flash"  # torch's FlashAttention varlen kernel: CUDA, fp16/bf16


def flash_supported(device: torch.device, dtype: torch.dtype, head_dim: int,
                    batch_invariant: bool = False) -> bool:
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if head_dim % 8 or head_dim > 256:
        return False
    if varlen_options(_varlen_attn(), batch_invariant) is None:
        return False
    return bool(torch.cuda.get_device_capability(device) >= (8, 0))


def _varlen_attn() -> Callable[..., Any]:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@dataclass(frozen=True, slots=True)
class VarlenOptions:
    keywords: dict[str, Any]  # causal attention, one split per row if asked
    repeat_kv: bool  # the kernel takes no grouped K/V heads: repeat them first


def varlen_options(varlen_attn: Callable[..., Any],
                   batch_invariant: bool) -> VarlenOptions | None:
    """How to call this torch's `varlen_attn` (its keywords changed from
    release to release: torch 2.10 has `is_causal`, 2.11 `window_size`, 2.12
    also `enable_gqa` and `num_splits`); None where it cannot keep a row's
    result independent of the batch when that is asked for."""
    params = inspect.signature(varlen_attn).parameters
    keywords: dict[str, Any] = {}
    if "window_size" in params:
        keywords["window_size"] = (-1, 0)  # causal, bottom-right aligned
    elif batch_invariant and "num_splits" not in params:
        return None  # is_causal alone lets the kernel split a row's keys
    else:
        keywords["is_causal"] = True
    if batch_invariant and "num_splits" in params:
        keywords["num_splits"] = 1
    if "enable_gqa" in params:
        keywords["enable_gqa"] = True
    return VarlenOptions(keywords, repeat_kv="enable_gqa" not in params)


@dataclass(frozen=True, slots=True)
class StepKeys:
    """Where each row's keys are, built once per step and shared by every layer."""

    groups: tuple[TileGroup, ...]  # torch
    packed_slots: torch.Tensor  # flash: slots of every sequence's keys, sequence after sequence
    cu_keys: torch.Tensor  # flash: [num_seqs + 1] int32 start of each sequence's keys
    cu_queries: torch.Tensor  # flash: [num_seqs + 1] int32


def key_slots(block_tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """[num_seqs, length]: slot of key position k of each sequence; positions past
    the table read block 0 (always masked)."""
    num_seqs, num_table = block_tables.shape
    offsets = torch.arange(block_size, device=block_tables.device)
    slots = (block_tables[:, :, None] * block_size + offsets).reshape(num_seqs, -1)
    if length > num_table * block_size:
        pad = slots.new_zeros(num_seqs, length - num_table * block_size)
        slots = torch.cat((slots, pad), dim=1)
    return slots[:, :length]


def packed_key_slots(step: DeviceStep, slots: torch.Tensor) -> torch.Tensor:
    """Slots of keys 0..context_len-1 of each sequence, concatenated, computed on
    the device from host-known sizes (no sync)."""
    total = int(step.host.context_lens.sum())
    num_seqs = step.host.num_seqs
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=slots.device),
                                  step.context_lens, output_size=total)
    starts = torch.cumsum(step.context_lens, 0) - step.context_lens
    pos = torch.arange(total, device=slots.device) - starts[seq]
    return slots[seq, pos]


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 backend: AttentionBackend, batch_invariant: bool, tiles: QueryTiles,
                 kv_chunk: int, dtype: torch.dtype, sum_by_chunk: bool | None = None) -> None:
        """dtype: the model's (scores and softmax run in at least float32).
        sum_by_chunk: add each tile's pairs one index_add_ per chunk (None:
        on any device but the CPU, whose index_add_ keeps index order)."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.backend = backend
        self.tiles = tiles
        self.kv_chunk = kv_chunk
        self.score_dtype = compute_dtype(dtype)
        self.scale = 1.0 / math.sqrt(head_dim)
        self.sum_by_chunk = sum_by_chunk
        if backend is AttentionBackend.FLASH:  # looked up once, not per layer and step
            self._varlen = _varlen_attn()
            options = varlen_options(self._varlen, batch_invariant)
            assert options is not None  # flash_supported said so
            self._varlen_options = options

    def prepare(self, step: DeviceStep) -> StepKeys:
        host = step.host
        if self.backend is AttentionBackend.TORCH:
            lens = np.diff(host.query_start)
            small = np.flatnonzero(lens <= self.tiles.small)
            large = np.flatnonzero(lens > self.tiles.small)
            heads = (self.num_kv_heads, self.num_heads // self.num_kv_heads)
            device = step.token_ids.device
            by_chunk = (device.type != "cpu" if self.sum_by_chunk is None
                        else self.sum_by_chunk)
            groups = tuple(plan_tiles(host, seqs, rows, self.block_size, self.kv_chunk, heads,
                                      self.score_dtype, device, by_chunk)
                           for seqs, rows in ((small, self.tiles.small),
                                              (large, self.tiles.large)) if len(seqs))
            none = step.context_lens[:0]
            return StepKeys(groups, none, none, none)
        slots = key_slots(step.block_tables, self.block_size, host.max_context_len)
        cu_keys = torch.zeros(host.num_seqs + 1, dtype=torch.int32, device=slots.device)
        torch.cumsum(step.context_lens, 0, out=cu_keys[1:])
        return StepKeys((), packed_key_slots(step, slots), cu_keys,
                        step.query_start.to(torch.int32))

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, step: DeviceStep,
                 keys: StepKeys, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [rows, heads, d]; cache [2, slots, kv_heads, d] with this step's K/V
        already written. Returns [rows, heads, d] (padding rows: unspecified),
        in `out` where given."""
        if self.backend is AttentionBackend.FLASH:
            return self._flash(q, cache, step, keys, out)
        attended = self._torch(q, cache, step, keys)
        return attended if out is None else out.copy_(attended)

    def _flash(self, q: torch.Tensor, cache: torch.Tensor, step: DeviceStep,
               keys: StepKeys, out: torch.Tensor | None) -> torch.Tensor:
        options = self._varlen_options
        n = step.host.num_tokens
        k = cache[0].index_select(0, keys.packed_slots)
        v = cache[1].index_select(0, keys.packed_slots)
        if options.repeat_kv and self.num_kv_heads != self.num_heads:
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attended = self._varlen(
            q[:n], k, v, keys.cu_queries, keys.cu_keys, step.host.max_query_len,
            step.host.max_context_len, **options.keywords)
        assert isinstance(attended, torch.Tensor)  # no aux outputs were asked for
        if out is None:
            out = torch.zeros_like(q)
        out[:n] = attended
        return out

    def _torch(self, q: torch.Tensor, cache: torch.Tensor, step: DeviceStep,
               keys: StepKeys) -> torch.Tensor:
        rows, d = q.shape[0], self.head_dim
        out = q.new_empty(rows + 1, self.num_heads, d)  # + the dump row
        q_rows, planes = q.reshape(-1, d), cache.view(2, -1, d)
        for group in keys.groups:
            out.view(-1, d).index_copy_(0, group.out_rows,
                                        self._attend(q_rows, planes, group).view(-1, d))
        return out[:rows]

    def _attend(self, q_rows: torch.Tensor, planes: torch.Tensor, g: TileGroup) -> torch.Tensor:
        """[tiles, kv heads, m, d]: every tile row's attention (m: tile rows x
        query heads per KV head), from q and the cache planes as one head's
        vector a row. Each (tile, chunk) pair scores its rows against its C
        keys; a row's weights are exp(score - the row's max over all its
        keys), and the pairs of a tile then add up in chunk order, from 0
        (`_by_tile`):

            out = (sum_j P_j V_j) / (sum_j P_j 1)

        (each P_j's row sums a vectorised reduction over its C keys, the
        same bits at any row count). Keys past a row's position weigh
        exactly 0, so chunks a row does not read add exactly nothing."""
        c, kv_heads, d = self.kv_chunk, self.num_kv_heads, self.head_dim
        m = g.rows * (self.num_heads // kv_heads)
        pairs, dtype = g.pairs * kv_heads, self.score_dtype
        qp = q_rows.index_select(0, g.query_rows).to(dtype).view(pairs, m, d).mul_(self.scale)
        # K^T laid out [d, C] in memory: some BLAS (MKL with AVX-512) give a
        # row other bits at 128+ rows when K^T is a transposed view, or in
        # baddbmm when a step has one product.
        kt = torch.empty(pairs, d, c, dtype=dtype, device=qp.device).copy_(
            planes[0].index_select(0, g.key_rows).view(pairs, c, d).mT)
        v = planes[1].index_select(0, g.key_rows).to(dtype).view(pairs, c, d)
        scores = torch.bmm(qp, kt)  # [pairs * kv, m, C]
        scores[(g.pairs - g.masked) * kv_heads:].add_(g.bias)
        top = scores.amax(dim=-1, keepdim=True).view(-1, kv_heads, m, 1)
        # Every row reads key 0, so its max over the tile's pairs is finite.
        row_max = top.new_full((g.tiles, kv_heads, m, 1), -math.inf).scatter_reduce_(
            0, g.pair_tile.view(-1, 1, 1, 1).expand_as(top), top, "amax")
        scores.sub_(row_max.index_select(0, g.pair_tile).view(pairs, m, 1))
        weights = elementwise.exp_(scores)
        per_pair = torch.bmm(weights, v).view(-1, kv_heads, m, d)
        sums = weights.sum(-1, keepdim=True).view(-1, kv_heads, m, 1)
        return (_by_tile(per_pair, g) / _by_tile(sums, g)).to(q_rows.dtype)


def _by_tile(values: torch.Tensor, g: TileGroup) -> torch.Tensor:
    """[tiles, ...]: the sum of each tile's pairs' `values` ([pairs, ...]),
    added in chunk order from 0."""
    total = values.new_zeros(g.tiles, *values.shape[1:])
    if not g.chunk_pairs:  # the CPU's index_add_ runs through the pairs in order
        return total.index_add_(0, g.pair_tile, values)
    for pairs, tiles in g.chunk_pairs:  # each tile at most once a call
        total.index_add_(0, tiles, values.index_select(0, pairs))
    return total
