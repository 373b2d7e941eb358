"""Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a
paged KV cache.

Parameter names match Hugging Face checkpoints (`model.layers.0.self_attn.q_proj.weight`,
...), so `state_dict()` keys are the checkpoint keys.

The KV cache is one tensor `[num_layers, 2 (k, v), num_blocks, block_size,
num_kv_heads, head_dim]`. A sequence's block table maps positions to slots:

    position p -> block_table[p // block_size], offset p % block_size

    positions  0 ............ start_pos ............ start_pos+n-1
               [ already in the cache ][ written by this call  ]
               [ read by attention (causal: query i sees keys <= its position) ]

These modules hold the weights and the token-wise pieces (norms, projections,
MLP, `apply_rotary`); the one forward over them is the runner's batched step
(`batched.py`), attention included. The per-sequence and plain causal forwards
the tests check it against live with the tests (tests/gpu_worker/oracle.py).
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.config import ModelConfig
from gpu_worker.products import Matmul, linear, stored_transposed


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms, softmax and rotary angles run at least in float32."""
    return torch.promote_types(dtype, torch.float32)


class Linear(nn.Module):
    """`nn.Linear` without its random init: weights are always loaded or filled."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(stored_transposed(out_features, in_features, dtype, device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    def forward(self, x: torch.Tensor, matmul: Matmul | None = None,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: the same weight laid out otherwise (batched.py's tied head)."""
        return linear(x, self.weight if weight is None else weight, self.bias, matmul)


class Fused:
    """Linears over the same input, their weights stacked in one tensor: each
    part keeps its own (checkpoint) name and is a view into the stack, so the
    step runs one matmul where there were several, with no second copy.

        weight  [ part 0 rows | part 1 rows | ... ]   [sum(out), in] (stored transposed)
    """

    def __init__(self, in_features: int, outs: tuple[int, ...], bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        total = sum(outs)
        self.weight = stored_transposed(total, in_features, dtype, device)
        self.bias = torch.empty(total, dtype=dtype, device=device) if bias else None
        self.parts: list[Linear] = []
        start = 0
        for out in outs:
            part = Linear(in_features, out, False, dtype, device)
            part.weight = nn.Parameter(self.weight[start:start + out], requires_grad=False)
            if self.bias is not None:
                part.bias = nn.Parameter(self.bias[start:start + out], requires_grad=False)
            self.parts.append(part)
            start += out

    def __call__(self, x: torch.Tensor, matmul: Matmul | None = None) -> torch.Tensor:
        """[rows, sum(outs)]: every part's output side by side."""
        return linear(x, self.weight, self.bias, matmul)


class OutputHead(Linear):
    """An output head that scores only `token_ids`: every other logit is the
    dtype's lowest value, so greedy choice never picks those tokens and
    sampling gives them probability 0 (exp underflows) at any temperature
    below |lowest| / 745: 2e305 in float64, the tiny model's default dtype,
    88 in float16. Not -inf: logits stay finite, so two runs' logits can be
    subtracted and compared (the tests' oracle does)."""

    blocked: torch.Tensor

    def __init__(self, in_features: int, vocab_size: int, token_ids: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(in_features, vocab_size, False, dtype, device)
        blocked = torch.ones(vocab_size, dtype=torch.bool, device=device)
        blocked[list(token_ids)] = False
        # Not a weight: no checkpoint stores it.
        self.register_buffer("blocked", blocked, persistent=False)

    def forward(self, x: torch.Tensor, matmul: Matmul | None = None,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(x, matmul, weight)
        return logits.masked_fill(self.blocked, torch.finfo(logits.dtype).min)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) (in at least float32), then times `weight` in x's dtype."""
    h = x.to(compute_dtype(x.dtype))
    h = h * h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return h.to(x.dtype).mul_(weight)


def rotary_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Per-channel-pair rotation speeds, float64, with Llama 3 scaling if configured."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-rotation convention (Llama/Qwen2): channel i pairs with i + head_dim/2.
    x: [n, heads, head_dim]; cos, sin: [n, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """The projections of one attention layer; the attention itself over the
    paged cache is `attention.PagedAttention`, run by `batched.py`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # Not a module: its parts are, under their checkpoint names.
        self.qkv = Fused(cfg.hidden_size, (q_size, kv_size, kv_size), cfg.attention_bias,
                         dtype, device)
        self.q_proj, self.k_proj, self.v_proj = self.qkv.parts
        self.o_proj = Linear(q_size, cfg.hidden_size, False, dtype, device)


class Mlp(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up = Fused(cfg.hidden_size, (size, size), False, dtype, device)  # see Attention
        self.gate_proj, self.up_proj = self.gate_up.parts
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = Mlp(cfg, dtype, device)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                         device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class CausalLM(nn.Module):
    """The decoder plus its output head: weights and rotary angles; the
    runner's batched step (`batched.py`) runs them."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.dtype = dtype
        self.device = device
        # Registered before lm_head so that, when tied, named_parameters() keeps
        # the embedding name (the one tied checkpoints store).
        self.model = Decoder(cfg, dtype, device)
        self.lm_head = (
            Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
            if cfg.output_token_ids is None
            else OutputHead(cfg.hidden_size, cfg.vocab_size, cfg.output_token_ids, dtype, device))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = cast(nn.Parameter, self.model.embed_tokens.weight)
        self._inv_freq = rotary_inv_freq(cfg).to(device)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, 1, head_dim] in the model's dtype (angles in float64)."""
        angles = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [n, 1, head_dim]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """CausalLM(cfg)'s named_parameters() as name -> shape, without allocating
    any: a checkpoint is checked against its config.json first."""
    h, d, mlp = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (mlp, h), "mlp.up_proj.weight": (mlp, h),
             "mlp.down_proj.weight": (h, mlp)}
    if cfg.attention_bias:
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                  "self_attn.v_proj.bias": (kv,)}
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


@torch.no_grad()
def fill_random(model: CausalLM, seed: int, std: float = 0.05) -> None:
    """Fixed-seed weights: identical on every device and dtype (drawn in float32
    on the CPU, then cast), varied enough that greedy text is not one token."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            values = torch.randn(param.shape, generator=gen)
        else:
            values = std * torch.randn(param.shape, generator=gen)
        param.copy_(values.to(param.dtype))


def build_tiny_model(cfg: ModelConfig, seed: int, dtype: torch.dtype,
                     device: torch.device | str) -> CausalLM:
    model = CausalLM(cfg, dtype, device)
    fill_random(model, seed)
    return model.eval()
