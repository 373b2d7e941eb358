"""One forward for a whole step: decodes and prefill chunks packed together.

    rows      [ a8 a9 a10 | b21 | c4 | pad ]   (see step_inputs)
    per layer:
      whole (or tile by tile)  norm -> q, k, v -> rotary      token-wise (see below)
      once                     write k, v of the real rows into their slots
      once                     paged attention over the block tables (attention.py)
      whole (or tile by tile)  o_proj + residual -> norm -> MLP + residual

Batch invariance. A row's numbers must not depend on which rows share its
step, or greedy outputs change when a request is preempted, restored or
recomputed (a recomputed output token is a prefill row, once it was a decode
row). Matmul, norm and softmax kernels choose their blocking, vector tails and
thread splits from the shape they see. So with `row_tile` set the step is
padded to whole tiles of `row_tile` rows and either

- `whole` steps (the default): each op runs once over all rows, padded to a
  multiple of `row_tile`, with matmuls whose rows' bits do not depend on the
  row count. CPU: GEMMs (MKL, oneDNN) compute rows in panels of 4
  (`query_tiles.GEMM_ROW_PANEL`, the CPU's `row_tile`), so at any row count
  that is a multiple of 4 a row gets the same bits, as long as the inner
  dimension is not split by row count (`products.k_pieces`); exp and silu go
  through `elementwise`, so that no row is cut into a scalar tail. GPU:
  cuBLAS picks kernels and split-K by shape, so matmuls run in a Triton
  kernel of one tile shape (`fixed_gemm`), on steps padded to 128 rows.
  Either is a property of the machine, not of torch's contract, so the
  runner checks it when it starts (`invariance.rows_match_alone`: steps of
  several sizes against each sequence alone, decode rows against the same
  token recomputed) and falls back to tiles where it does not hold; or
- tiles (the fallback, and GPUs without Triton): every token-wise op runs
  on slices of exactly `row_tile` rows, so each kernel sees one shape only.

On CUDA, whole steps of up to `cuda_graph_rows` rows replay the token-wise
pieces as CUDA graphs, the cache writes and attention run between them
(step_graphs.py): the same kernels on the same shapes, from 17 graph
launches for 16 layers instead of one launch per op.

Rotary angles come from a table (a gather, not a computation per step).
Attention is invariant by its own construction (attention.py), on the same
kind of matmul.
`row_tile=None` runs each op once over the rows unpadded: not invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker import elementwise, fixed_gemm
from gpu_worker.attention import AttentionBackend, PagedAttention, StepKeys, flash_supported
from gpu_worker.config import DEFAULT_CUDA_GRAPH_ROWS
from gpu_worker.model import CausalLM, DecoderLayer, RMSNorm, rms_norm
from gpu_worker.products import Matmul, Product, k_pieces, product_of, stored_transposed
from gpu_worker.query_tiles import QueryTiles
from gpu_worker.step_graphs import StepGraphs
from gpu_worker.step_inputs import DeviceStep


def rotary_table(model: CausalLM, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [length, 1, head_dim] in the model's dtype, for `rotate`:
    model.rotary's angles, sin negated on the first half."""
    cos, sin = model.rotary(torch.arange(length, device=model.device))
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`model.apply_rotary`, bit for bit, in four ops instead of seven:
    [-x2, x1] * sin == roll(x) * [-sin, sin] exactly."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def default_row_tile(device: torch.device) -> int:
    # CPU: small enough that a lone decode row costs little to pad; GPU: one
    # tile holds a full decode batch of up to 128 sequences (unmeasured choice).
    return 128 if device.type == "cuda" else 16


def invariant_matmul(device: torch.device, dtype: torch.dtype) -> Matmul:
    """The matmul of whole invariant steps on this device (see above)."""
    if device.type == "cpu":
        return k_pieces
    if not fixed_gemm.available(device, dtype):
        raise ValueError(f"whole batch-invariant steps on {device} need Triton "
                         f"(fixed_gemm) and a dtype it has a tile for; got {dtype}")
    return fixed_gemm.matmul


@dataclass(frozen=True, slots=True)
class LayerOps:
    """One decoder layer's norms and products, each weight bound to the step's
    matmul once (products.product_of), not looked at again on every call."""

    norm_in: RMSNorm
    qkv: Product
    o_proj: Product
    norm_post: RMSNorm
    gate_up: Product
    down: Product
    heads: tuple[int, int, int]  # query heads, KV heads, head dim

    @staticmethod
    def of(layer: object, matmul: Matmul | None) -> LayerOps:
        """Holds `layer`'s tensors as they are: weights loaded later must be
        copied into them (checkpoint.py, fill_random), not put in their place."""
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        return LayerOps(layer.input_layernorm,
                        product_of(attn.qkv.weight, attn.qkv.bias, matmul),
                        product_of(attn.o_proj.weight, attn.o_proj.bias, matmul),
                        layer.post_attention_layernorm,
                        product_of(mlp.gate_up.weight, mlp.gate_up.bias, matmul),
                        product_of(mlp.down_proj.weight, mlp.down_proj.bias, matmul),
                        (attn.num_heads, attn.num_kv_heads, attn.head_dim))

    def qkv_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, projections and rotary of rows `x`: q [rows, heads, d], k, v
        [rows, kv, d] (views into one matmul's output)."""
        heads, kv_heads, d = self.heads
        rows, qk = x.shape[0], (heads + kv_heads) * d
        qkv = self.qkv(rms_norm(x, self.norm_in.weight, self.norm_in.eps))
        rotated = rotate(qkv[:, :qk].view(rows, heads + kv_heads, d), cos, sin)
        return rotated[:, :heads], rotated[:, heads:], qkv[:, qk:].view(rows, kv_heads, d)

    def rest(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection and residual, norm, MLP and residual."""
        h = self.o_proj(attended).add_(x)
        gate_up = self.gate_up(rms_norm(h, self.norm_post.weight, self.norm_post.eps))
        size = gate_up.shape[1] // 2
        gate = elementwise.silu_(gate_up[:, :size])
        return self.down(gate * gate_up[:, size:]).add_(h)


class BatchedForward:
    def __init__(self, model: CausalLM, block_size: int, max_model_len: int,
                 row_tile: int | None, whole: bool, attention: AttentionBackend | None = None,
                 kv_chunk: int = 128) -> None:
        """row_tile: steps are padded to whole tiles (None: not invariant);
        whole: each op once over all rows (see above), else tile by tile.
        attention None: flash where it runs (CUDA, fp16/bf16), else torch."""
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
        self.whole = whole
        self.matmul = (invariant_matmul(model.device, model.dtype)
                       if whole and row_tile is not None else None)
        # A tied output head lies [out, in], as the embedding does: there an AMD
        # EPYC's MKL gives a row of k_pieces' product other bits by the row
        # count (an AVX-512 Xeon's does not), so whole CPU steps multiply a
        # copy laid out [in, out], the embedding's size once more.
        head = model.lm_head.weight
        self._head_weight = stored_transposed(
            cfg.vocab_size, cfg.hidden_size, head.dtype, head.device).copy_(head) if (
            self.matmul is k_pieces and not head.t().is_contiguous()) else None
        self.layers = [LayerOps.of(layer, self.matmul) for layer in model.model.layers]
        invariant = row_tile is not None
        tiles = QueryTiles.for_heads(cfg.num_heads // cfg.num_kv_heads,
                                     fixed=invariant and not self.whole)
        self.attention = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                        block_size, attention, invariant, tiles, kv_chunk,
                                        model.dtype)
        self.cos, self.sin = rotary_table(model, max_model_len)
        self.graphs: StepGraphs | None = None  # see use_graphs

    @property
    def numerics(self) -> str:
        """What decides the bits this step writes beyond tokens, weights and
        dtype (WorkerInfo.numerics): the hardware, torch, and the step's kernels."""
        device = self.model.device
        hardware = (torch.cuda.get_device_name(device) if device.type == "cuda"
                    else f"{device.type} {torch.backends.cpu.get_cpu_capability()}")
        kernels = ("plain" if self.row_tile is None else "whole" if self.whole
                   else f"tiles of {self.row_tile}")
        return (f"{hardware}|torch {torch.__version__}|{kernels} steps|"
                f"{self.attention.backend.value} attention")

    def _tiles(self, rows: int) -> list[slice]:
        if self.whole or self.row_tile is None:  # the latter: for the type checker
            return [slice(0, rows)]
        return [slice(i, i + self.row_tile) for i in range(0, rows, self.row_tile)]

    def use_graphs(self, max_rows: int | None = None) -> None:
        """Whole padded (invariant) steps on CUDA of at most `max_rows` rows
        (None: DEFAULT_CUDA_GRAPH_ROWS) replay CUDA graphs (step_graphs.py): a
        few row counts cover them. Anywhere else, or with 0, nothing changes."""
        max_rows = DEFAULT_CUDA_GRAPH_ROWS if max_rows is None else max_rows
        if self.whole and self.row_tile and self.model.device.type == "cuda" and max_rows:
            self.graphs = StepGraphs(self, max_rows)

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' embeddings and rotary cos, sin."""
        return self.model.model.embed_tokens(token_ids), self.cos[positions], self.sin[positions]

    def qkv(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's q, k, v of the whole step's rows."""
        return self.layers[i].qkv_rows(x, cos, sin)

    def attend(self, cache: torch.Tensor, step: DeviceStep, keys: StepKeys,
               qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Writes the real rows' k, v into their slots of one layer's `cache`
        ([2, slots, kv_heads, d]), then attends: [rows, heads, d], in `out`
        where given."""
        q, k, v = qkv
        n = step.host.num_tokens
        cache[0].index_copy_(0, step.write_slots, k[:n])
        cache[1].index_copy_(0, step.write_slots, v[:n])
        return self.attention(q, cache, step, keys, out)

    def rest(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Layer i's output rows from its input rows and their attention."""
        return self.layers[i].rest(x, attended)

    @torch.inference_mode()
    def hidden(self, step: DeviceStep, kv_cache: torch.Tensor) -> torch.Tensor:
        """Runs the first `len(kv_cache)` layers (all, but for a check) over
        the packed rows, writing their K/V into `kv_cache`; returns the last
        one's output [rows, hidden] (before the final norm)."""
        cfg = self.model.config
        num_layers, _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        flat = kv_cache.view(num_layers, 2, num_blocks * block_size, kv_heads, head_dim)
        rows = step.host.num_rows
        keys = self.attention.prepare(step)
        if self.graphs is not None and rows <= self.graphs.max_rows:
            graphed = self.graphs.hidden(step, flat, keys)
            if graphed is not None:
                return graphed
        tiles = self._tiles(rows)
        x, cos, sin = self.embed(step.token_ids, step.positions)
        if not self.whole:
            q = x.new_empty(rows, cfg.num_heads, head_dim)
            k = x.new_empty(rows, kv_heads, head_dim)
            v = x.new_empty(rows, kv_heads, head_dim)
        for i, layer in enumerate(self.layers[:num_layers]):
            if self.whole:
                q, k, v = layer.qkv_rows(x, cos, sin)
            else:
                for t in tiles:
                    q[t], k[t], v[t] = layer.qkv_rows(x[t], cos[t], sin[t])
            out = self.attend(flat[i], step, keys, (q, k, v)).view(rows, -1)
            if self.whole:
                x = layer.rest(x, out)
            else:
                for t in tiles:
                    x[t] = layer.rest(x[t], out[t])
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output head, tile by tile: [rows, vocab]."""
        parts = [self.model.lm_head(self.model.model.norm(hidden[t]), self.matmul,
                                    self._head_weight)
                 for t in self._tiles(hidden.shape[0])]
        return torch.cat(parts) if len(parts) != 1 else parts[0]
