"""Loading a model: the built-in tiny one, or a local Llama / Qwen2 directory.

A checkpoint directory holds `config.json`, one or more `*.safetensors` files
with Hugging Face tensor names, and `tokenizer.json`. Nothing is downloaded.
Tensor names and shapes are checked against the model before any is copied,
so a wrong checkpoint fails with every problem named instead of half-loading.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from gpu_worker.config import (
    TINY_MODEL,
    Llama3RopeScaling,
    ModelConfig,
    WorkerConfig,
    tiny_model_config,
)
from gpu_worker.model import CausalLM, build_tiny_model

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
# Older Llama exports store the rotary table; it is recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    model: CausalLM
    tokenizer_json: str  # "" = the byte-level tokenizer of the tiny model


TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {list(TORCH_DTYPES)}, got {name!r}")
    return TORCH_DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but torch sees no CUDA device")
    return torch.device(name)


def load_model(config: WorkerConfig) -> LoadedModel:
    dtype, device = torch_dtype(config.dtype), resolve_device(config.device)
    if config.model == TINY_MODEL:
        model = build_tiny_model(tiny_model_config(), config.seed, dtype, device)
        return LoadedModel(TINY_MODEL, model, "")
    return load_checkpoint(Path(config.model), dtype, device)


def _eos_ids(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    return (int(raw),) if isinstance(raw, int) else tuple(int(t) for t in raw)


def _rope_scaling(raw: dict[str, Any] | None) -> Llama3RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (only llama3)")
    return Llama3RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None
                       ) -> ModelConfig:
    """A Hugging Face `config.json` (as a dict) -> ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        if eos is None and generation is not None:
            eos = generation.get("eos_token_id")
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_model_len=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            eos_token_ids=_eos_ids(eos),
            rope_scaling=_rope_scaling(raw.get("rope_scaling")),
        )
    except KeyError as exc:
        raise ValueError(f"config.json lacks {exc.args[0]!r}") from None


def _tensor_index(directory: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor name in the directory's safetensors files -> (file, shape)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    index: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in index:
                    raise ValueError(f"tensor {name} is in both {index[name][0]} and {path}")
                index[name] = (path, tuple(f.get_slice(name).get_shape()))
    return index


def check_tensors(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]],
                  optional: set[str]) -> None:
    """Raises ValueError listing every missing, unexpected and mis-shaped tensor."""
    problems = [f"missing tensor {n} (want shape {list(s)})"
                for n, s in expected.items() if n not in found]
    problems += [f"unexpected tensor {n} (shape {list(s)})" for n, s in found.items()
                 if n not in expected and n not in optional
                 and not n.endswith(_IGNORED_SUFFIXES)]
    problems += [f"tensor {n} has shape {list(found[n])}, want {list(s)}"
                 for n, s in expected.items() if n in found and found[n] != s]
    if problems:
        raise ValueError("checkpoint does not match config.json: " + "; ".join(problems))


@torch.no_grad()
def load_weights(model: CausalLM, directory: Path) -> None:
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    index = _tensor_index(directory)
    optional = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    check_tensors({n: tuple(p.shape) for n, p in params.items()},
                  {n: shape for n, (_, shape) in index.items()}, optional)
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(index[name][0], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                params[name].copy_(f.get_tensor(name))


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, dict):
        return data
    raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object")


def load_checkpoint(directory: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    config_path, tokenizer_path = directory / "config.json", directory / "tokenizer.json"
    for required in (config_path, tokenizer_path):
        if not required.is_file():
            raise ValueError(f"checkpoint directory {directory} has no {required.name}")
    generation_path = directory / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else None
    cfg = parse_model_config(_read_json(config_path), generation)
    model = CausalLM(cfg, dtype, device)
    load_weights(model, directory)
    name = os.path.basename(os.path.normpath(directory))
    return LoadedModel(name, model.eval(), tokenizer_path.read_text(encoding="utf-8"))
