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
- `torch`: plain torch, any device and dtype, the CPU path. Rows go in tiles of
  `row_tile` queries, keys in chunks of `kv_chunk` positions aligned at 0, with
  an online softmax across chunks:

      keys of a row at position p:  [0 .. C-1][C .. 2C-1] ... [jC .. p ... (j+1)C-1]
      chunk j of every row in the tile: one gather, one matmul [tile, C], masked > p

  Every kernel call has one shape whatever the batch, and the chunks a row
  reads past its own position add exactly 0 (weights exp(-inf) = 0, rescale
  exp(0) = 1), so a row's result is the same bits alone or in any batch.
"""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.model import compute_dtype
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

    key_slots: torch.Tensor  # torch: [num_seqs, padded context] slot of every key position
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
                 backend: AttentionBackend, row_tile: int | None, kv_chunk: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.backend = backend
        self.row_tile = row_tile
        self.kv_chunk = kv_chunk
        self.scale = 1.0 / math.sqrt(head_dim)
        if backend is AttentionBackend.FLASH:  # looked up once, not per layer and step
            self._varlen = _varlen_attn()
            options = varlen_options(self._varlen, row_tile is not None)
            assert options is not None  # flash_supported said so
            self._varlen_options = options

    def prepare(self, step: DeviceStep) -> StepKeys:
        length = step.host.max_context_len
        slots = key_slots(step.block_tables, self.block_size,
                          -(-length // self.kv_chunk) * self.kv_chunk)
        if self.backend is AttentionBackend.TORCH:
            return StepKeys(slots, slots[:0, 0], slots[:0, 0], slots[:0, 0])
        cu_keys = torch.zeros(step.host.num_seqs + 1, dtype=torch.int32, device=slots.device)
        torch.cumsum(step.context_lens, 0, out=cu_keys[1:])
        return StepKeys(slots, packed_key_slots(step, slots), cu_keys,
                        step.query_start.to(torch.int32))

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, step: DeviceStep,
                 keys: StepKeys) -> torch.Tensor:
        """q [rows, heads, d]; cache [2, slots, kv_heads, d] with this step's K/V
        already written. Returns [rows, heads, d] (padding rows: unspecified)."""
        if self.backend is AttentionBackend.FLASH:
            return self._flash(q, cache, step, keys)
        return self._torch(q, cache, step, keys)

    def _flash(self, q: torch.Tensor, cache: torch.Tensor, step: DeviceStep,
               keys: StepKeys) -> torch.Tensor:
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
        out = torch.zeros_like(q)
        out[:n] = attended
        return out

    def _torch(self, q: torch.Tensor, cache: torch.Tensor, step: DeviceStep,
               keys: StepKeys) -> torch.Tensor:
        rows = q.shape[0]
        tile = self.row_tile or rows
        out = torch.empty_like(q)
        positions = step.host.positions
        for start in range(0, rows, tile):
            last = int(positions[start:start + tile].max())
            out[start:start + tile] = self._torch_tile(
                q[start:start + tile], cache, step.token_seq[start:start + tile],
                step.positions[start:start + tile], keys.key_slots, last // self.kv_chunk + 1)
        return out

    def _torch_tile(self, q: torch.Tensor, cache: torch.Tensor, seq: torch.Tensor,
                    pos: torch.Tensor, slots: torch.Tensor, num_chunks: int) -> torch.Tensor:
        rows, c = q.shape[0], self.kv_chunk
        kv_heads, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        acc_dtype = compute_dtype(q.dtype)
        qg = (q.to(acc_dtype) * self.scale).view(rows, kv_heads, group, self.head_dim)
        row_slots = slots[seq]  # [rows, padded context]
        key_pos = torch.arange(c, device=q.device)
        run_max = denom = acc = torch.empty(0)
        for j in range(num_chunks):
            invalid = (key_pos + j * c)[None, :] > pos[:, None]  # [rows, C]
            # Masked weights are 0, but 0 * NaN is not, and slots past a row's
            # position may hold anything: those read the row's key 0 instead.
            chunk_slots = torch.where(invalid, row_slots[:, :1], row_slots[:, j * c:(j + 1) * c])
            kv = cache.index_select(1, chunk_slots.reshape(-1)).to(acc_dtype)
            k, v = kv.view(2, rows, c, kv_heads, self.head_dim).unbind(0)  # [rows, C, kv, d]
            scores = qg @ k.permute(0, 2, 3, 1)  # [rows, kv_heads, group, C]
            scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
            chunk_max = scores.amax(dim=-1, keepdim=True)
            if j == 0:  # key 0 is every row's: the max is finite
                run_max = chunk_max
                p = torch.exp(scores - run_max)
                denom = p.sum(dim=-1, keepdim=True)
                acc = p @ v.permute(0, 2, 1, 3)
                continue
            new_max = torch.maximum(run_max, chunk_max)
            alpha = torch.exp(run_max - new_max)
            p = torch.exp(scores - new_max)
            denom = denom * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + p @ v.permute(0, 2, 1, 3)
            run_max = new_max
        out = acc / denom  # [rows, kv_heads, group, d]
        return out.reshape(rows, self.num_heads, self.head_dim).to(q.dtype)
