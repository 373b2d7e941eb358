"""One forward for a whole step: decodes and prefill chunks packed together.

    rows      [ a8 a9 a10 | b21 | c4 | pad ]   (see step_inputs)
    per layer:
      tile by tile  norm -> q, k, v -> rotary          token-wise, fixed [row_tile, ...] shapes
      once          write k, v of the real rows into their slots
      once          paged attention over the block tables (attention.py)
      tile by tile  o_proj + residual -> norm -> MLP + residual

Batch invariance. A row's numbers must not depend on which rows share its
step, or greedy outputs change when a request is preempted, restored or
recomputed (a recomputed output token is a prefill row, once it was a decode
row). Matmul, norm and softmax kernels choose their blocking, vector tails and
thread splits from the shape they see; so with `row_tile` set every token-wise
op runs on slices of exactly `row_tile` rows (the step is padded to whole
tiles), and each kernel sees one shape only. Rotary angles come from a table
(a gather, not a computation per step). Attention is invariant by its own
construction. `row_tile=None` runs each op once over all rows instead: faster
on big batches, not invariant.
"""

from __future__ import annotations

import torch

from gpu_worker.attention import AttentionBackend, PagedAttention, flash_supported
from gpu_worker.model import CausalLM, DecoderLayer, apply_rotary
from gpu_worker.step_inputs import DeviceStep


def rotary_table(model: CausalLM, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, 1, head_dim] in the model's dtype, as model.rotary makes them."""
    return model.rotary(torch.arange(length, device=model.device))


def default_row_tile(device: torch.device) -> int:
    # CPU: small enough that a lone decode row costs little to pad; GPU: one
    # tile holds a full decode batch of up to 128 sequences (unmeasured choice).
    return 128 if device.type == "cuda" else 16


class BatchedForward:
    def __init__(self, model: CausalLM, block_size: int, max_model_len: int,
                 row_tile: int | None, attention: AttentionBackend | None = None,
                 kv_chunk: int = 64) -> None:
        """attention None: flash where it runs (CUDA, fp16/bf16), else torch."""
        cfg = model.config
        if row_tile is not None and row_tile < 1:
            raise ValueError(f"row_tile must be >= 1 or None, got {row_tile}")
        flash = flash_supported(model.device, model.dtype, cfg.head_dim,
                                batch_invariant=row_tile is not None)
        if attention is AttentionBackend.FLASH and not flash:
            raise ValueError(f"flash attention needs CUDA (sm80+) and fp16/bf16 with head_dim "
                             f"<= 256 (and, for batch invariance, a torch whose varlen_attn "
                             f"takes num_splits or window_size); got {model.device}, "
                             f"{model.dtype}, {cfg.head_dim}")
        if attention is None:
            attention = AttentionBackend.FLASH if flash else AttentionBackend.TORCH
        self.model = model
        self.row_tile = row_tile
        self.attention = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                        block_size, attention, row_tile, kv_chunk)
        self.cos, self.sin = rotary_table(model, max_model_len)

    def _tiles(self, rows: int) -> list[slice]:
        tile = self.row_tile or max(rows, 1)
        return [slice(i, i + tile) for i in range(0, rows, tile)]

    @torch.inference_mode()
    def hidden(self, step: DeviceStep, kv_cache: torch.Tensor) -> torch.Tensor:
        """Runs every layer over the packed rows, writing their K/V into
        `kv_cache`; returns the last layer's output [rows, hidden] (before the
        final norm)."""
        cfg = self.model.config
        num_layers, _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        flat = kv_cache.view(num_layers, 2, num_blocks * block_size, kv_heads, head_dim)
        rows, n = step.host.num_rows, step.host.num_tokens
        tiles = self._tiles(rows)
        x = self.model.model.embed_tokens(step.token_ids)
        cos, sin = self.cos[step.positions], self.sin[step.positions]
        keys = self.attention.prepare(step)
        q = x.new_empty(rows, cfg.num_heads, head_dim)
        k = x.new_empty(rows, kv_heads, head_dim)
        v = x.new_empty(rows, kv_heads, head_dim)
        for i, layer in enumerate(self.model.model.layers):
            assert isinstance(layer, DecoderLayer)
            attn = layer.self_attn
            for t in tiles:
                h = layer.input_layernorm(x[t])
                q[t] = apply_rotary(attn.q_proj(h).view(-1, cfg.num_heads, head_dim),
                                    cos[t], sin[t])
                k[t] = apply_rotary(attn.k_proj(h).view(-1, kv_heads, head_dim), cos[t], sin[t])
                v[t] = attn.v_proj(h).view(-1, kv_heads, head_dim)
            flat[i, 0].index_copy_(0, step.write_slots, k[:n])
            flat[i, 1].index_copy_(0, step.write_slots, v[:n])
            out = self.attention(q, flat[i], step, keys).view(rows, -1)
            for t in tiles:
                h = x[t] + attn.o_proj(out[t])
                x[t] = h + layer.mlp(layer.post_attention_layernorm(h))
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output head, tile by tile: [rows, vocab]."""
        parts = [self.model.lm_head(self.model.model.norm(hidden[t]))
                 for t in self._tiles(hidden.shape[0])]
        return torch.cat(parts) if len(parts) != 1 else parts[0]
