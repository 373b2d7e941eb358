"""Worker settings and model shapes: validated once, at start-up, then frozen.

Nothing here imports torch, so the CLI can parse and reject flags before the
(slow) torch import happens.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from kvstash.common.binding import MAX_PORT, port_past_range
from kvstash.common.metrics import DEFAULT_METRICS_HOST, listen_host
from kvstash.common.rpc_connections import DEFAULT_CONNECTIONS, Connections
from kvstash.common.security import PLAINTEXT, Security
from kvstash.common.tokenizer import BYTE_EOS_ID, TINY_TEXT_IDS
from kvstash.common.units import GIB

AUTO_DTYPE = "auto"  # a checkpoint's own dtype; float64 for the tiny model
DTYPES = (AUTO_DTYPE, "float32", "float64", "float16", "bfloat16")
TINY_MODEL = "tiny"
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


DEFAULT_HOST_POOL_BYTES = 2 * GIB
# Whole invariant steps on CUDA of at most this many rows replay CUDA graphs
# (step_graphs.py): decodes and mixed steps with chunks up to ~2k tokens, 16
# row counts at a row tile of 128 (at Llama-3.2-1B's shapes ~250 MiB of
# graph buffers in all); longer steps are bound by their kernels.
DEFAULT_CUDA_GRAPH_ROWS = 2048
# Each row count keeps its own buffers, so their memory sums over the counts
# captured: at this bound 64 counts, ~4 GiB at the 1B shape.
MAX_CUDA_GRAPH_ROWS = 8192
# Most positions a worker serves (max_model_len): the rotary table holds a row
# for each (at 2**24, head_dim 128 and bfloat16 cos and sin take 8 GiB).
# Well past the longest contexts Llama and Qwen2 checkpoints declare (1M-4M):
# a larger number is a mistake, which would only fail to allocate.
MAX_MODEL_LEN = 1 << 24


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: str = TINY_MODEL  # "tiny" (random weights, byte tokenizer) or a checkpoint directory
    dtype: str = AUTO_DTYPE  # weights, activations and KV cache (see AUTO_DTYPE)
    device: str = "auto"  # "auto" = cuda when available, else cpu
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 512  # blocks in the KV-cache tensor
    max_model_len: int | None = None  # cap at or below the model's own limit; None = the model's
    cache_address: str = ""  # KV cache service "host:port"; "" = offload unavailable
    # Bound on an offload or restore whose caller sent no deadline (a caller's
    # deadline, e.g. the scheduler's transfer timeout, governs otherwise).
    cache_timeout_s: float = 60.0
    # Move KV through the cache's shared-memory arena when it can be mapped
    # here (same host and user); off = always stream over gRPC.
    cache_arena: bool = True
    seed: int = 0  # tiny-model weights and unseeded sampling
    # A row's numbers do not depend on the rest of its step (gpu_worker/batched.py):
    # greedy outputs stay identical under preemption. Off: faster, not invariant.
    batch_invariant: bool = True
    # Invariant steps in tiles of this many rows; None = whole steps on CPU
    # where its start-up check passes, else the device's tile (batched.py).
    row_tile: int | None = None
    cuda_graph_rows: int = DEFAULT_CUDA_GRAPH_ROWS  # 0 = no CUDA graphs
    # torch's intra-op threads (process-wide); 0 = the CPUs this process may
    # use (kvstash.common.cpu: affinity mask, cgroup quota), not torch's
    # default of one per node core: threads beyond the CPUs granted stall
    # every parallel region and the services beside it.
    num_threads: int = 0
    # Idle pooled host buffers for offload/restore kept at most (pinned on CUDA).
    host_pool_bytes: int = DEFAULT_HOST_POOL_BYTES
    metrics_port: int = 0  # Prometheus /metrics port; 0 = off
    metrics_host: str = DEFAULT_METRICS_HOST  # /metrics listens here; 0.0.0.0 = everywhere
    # TLS of its server (mutual: only peers the CA signed) and of its channel
    # to the cache service (kvstash.common.security).
    security: Security = PLAINTEXT
    connections: Connections = DEFAULT_CONNECTIONS  # keepalive, idle and stream limits

    def __post_init__(self) -> None:
        if self.model != TINY_MODEL and not os.path.isdir(self.model):
            raise ValueError(f"model must be {TINY_MODEL!r} or a directory; {self.model!r} is not")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not _DEVICE_RE.match(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0 = the usable CPUs), "
                             f"got {self.num_threads}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_model_len is not None and not 1 <= self.max_model_len <= MAX_MODEL_LEN:
            raise ValueError(f"max_model_len must be in [1, {MAX_MODEL_LEN}], "
                             f"got {self.max_model_len}")
        if self.cache_address and (":" not in self.cache_address
                                   or port_past_range(self.cache_address)):
            raise ValueError(f"cache_address must be host:port (port 0-{MAX_PORT}), "
                             f"got {self.cache_address!r}")
        # NaN passes `<= 0`, and a transfer bounded by NaN or inf never times out.
        if not (math.isfinite(self.cache_timeout_s) and self.cache_timeout_s > 0):
            raise ValueError(f"cache_timeout_s must be finite and > 0, got {self.cache_timeout_s}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.row_tile is not None and not 1 <= self.row_tile <= 4096:
            raise ValueError(f"row_tile must be in [1, 4096], got {self.row_tile}")
        if not 0 <= self.cuda_graph_rows <= MAX_CUDA_GRAPH_ROWS:
            raise ValueError(f"cuda_graph_rows must be in [0, {MAX_CUDA_GRAPH_ROWS}], "
                             f"got {self.cuda_graph_rows}")
        if self.host_pool_bytes < 0:
            raise ValueError(f"host_pool_bytes must be >= 0, got {self.host_pool_bytes}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        listen_host(self.metrics_host, "metrics_host")


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1+ stretches low rotary frequencies for long context."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes of a Llama-family decoder (Llama, Qwen2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads = grouped-query attention
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_model_len: int
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    attention_bias: bool  # q/k/v projections have biases (Qwen2)
    eos_token_ids: tuple[int, ...]
    rope_scaling: Llama3RopeScaling | None = None
    # config.json's model_type (hf_config.SUPPORTED_MODEL_TYPES); the tiny
    # model is Llama-shaped.
    model_type: str = "llama"
    # The only tokens the output head may produce (model.OutputHead gives every
    # other the lowest logit); None = every token. The tiny model writes
    # printable text this way.
    output_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_model_len"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(
                f"rope_theta ({self.rope_theta}) and rms_norm_eps ({self.rms_norm_eps}) "
                "must be > 0"
            )
        bad_eos = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad_eos:
            raise ValueError(f"eos_token_ids {bad_eos} outside vocab of {self.vocab_size}")
        if self.output_token_ids is not None:
            if not self.output_token_ids:
                raise ValueError("output_token_ids is empty: the model could write nothing")
            bad_out = [t for t in self.output_token_ids if not 0 <= t < self.vocab_size]
            if bad_out:
                raise ValueError(f"output_token_ids {bad_out[:8]} outside vocab of "
                                 f"{self.vocab_size}")


def tiny_model_config() -> ModelConfig:
    """The built-in model: byte vocabulary (kvstash.common.tokenizer.ByteTokenizer), of
    which it writes only printable text (TINY_TEXT_IDS) and EOS; a few layers, GQA
    with two query heads per KV head. Runs anywhere in milliseconds."""
    return ModelConfig(
        vocab_size=258,
        hidden_size=128,
        intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_model_len=1024,
        tie_word_embeddings=False,
        attention_bias=False,
        eos_token_ids=(BYTE_EOS_ID,),
        output_token_ids=(*TINY_TEXT_IDS, BYTE_EOS_ID),
    )
