"""Reading a Hugging Face `config.json` (and `generation_config.json`) into a ModelConfig.

Both layouts transformers has written are read: before version 5, `rope_theta`
at the top level and scaling under `rope_scaling`; from version 5 on, both
under `rope_parameters`. Any field that would change the math of a model this
worker does not implement (another activation, sliding windows, a RoPE
variant, biases Llama does not have here, quantized weights) is refused with
the field and its value named: loading it anyway would serve wrong logits
without a single error.

No torch here: it parses JSON only.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from gpu_worker.config import Llama3RopeScaling, ModelConfig

# Each model type this worker runs -> its Hugging Face class, as vLLM names
# the architecture to gateways.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Checkpoint dtypes `--dtype auto` takes as they are.
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16", "float64")
_DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config names none
_REQUIRED = object()
_EXPECTED = {int: "a positive integer", float: "a finite number", bool: "true or false",
             list: "a list"}


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json {field}={value!r} is not supported: {why}")


def _is(value: Any, kind: type) -> bool:
    """As JSON reads: a bool is no number, an integer is also a float."""
    if kind is float:
        return type(value) in (int, float) and math.isfinite(value)
    if kind is int:
        return type(value) is int and value >= 1
    return type(value) is kind


def _get(raw: dict[str, Any], field: str, kind: type, default: Any = _REQUIRED,
         prefix: str = "") -> Any:
    """raw[field], a ValueError naming it unless it is a `kind` (see _EXPECTED);
    `default` when absent. null is taken only where the default is None (a
    value derived from others, as head_dim is)."""
    value = raw.get(field, default)
    if value is _REQUIRED:
        raise ValueError(f"config.json lacks {prefix + field!r}")
    if value is None and default is None:
        return None
    if not _is(value, kind):
        raise ValueError(f"config.json {prefix}{field}={value!r}: expected {_EXPECTED[kind]}")
    return value


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of either layout, as one flat dict with rope_type and
    rope_theta. `rope_scaling` wins over `rope_parameters`, as in transformers."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise _refuse("rope_parameters", params, "expected an object")
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        raise _refuse(f"rope_parameters.{nested[0]}", params[nested[0]],
                      "per-layer-type RoPE is not implemented")
    out = dict(params)
    out["rope_type"] = params.get("rope_type", params.get("type", "default"))
    # Theta may sit at the top level or in either dict, whichever layout wrote it.
    new_layout = raw.get("rope_parameters")
    holders = [params, raw, new_layout if isinstance(new_layout, dict) else {}]
    holder = next((h for h in holders if h.get("rope_theta") is not None), {})
    out["rope_theta"] = float(_get(holder, "rope_theta", float, _DEFAULT_ROPE_THETA))
    return out


def _rope_scaling(params: dict[str, Any], max_position_embeddings: int
                  ) -> Llama3RopeScaling | None:
    kind = params["rope_type"]
    if kind not in SUPPORTED_ROPE_TYPES:
        raise _refuse("rope_type", kind, f"only {', '.join(SUPPORTED_ROPE_TYPES)} are implemented")
    where = "rope_parameters."
    factor = _get(params, "partial_rotary_factor", float, 1.0, where)
    if factor != 1.0:
        raise _refuse("partial_rotary_factor", factor, "RoPE is applied to the whole head")
    if kind == "default":
        return None
    scale = float(_get(params, "factor", float, prefix=where))
    if scale <= 0:  # low rotary speeds are divided by it: infinite angles, NaN logits
        raise _refuse("rope_parameters.factor", scale, "a Llama 3 factor must be > 0")
    low = float(_get(params, "low_freq_factor", float, prefix=where))
    high = float(_get(params, "high_freq_factor", float, prefix=where))
    # Wavelength bounds divide by each, the blend by their difference.
    if not 0 < low < high:
        raise _refuse("rope_parameters.low_freq_factor", low,
                      f"a Llama 3 scaling needs 0 < low_freq_factor < high_freq_factor ({high})")
    return Llama3RopeScaling(
        factor=scale, low_freq_factor=low, high_freq_factor=high,
        original_max_position_embeddings=_get(params, "original_max_position_embeddings",
                                              int, max_position_embeddings, where))


def check_supported(raw: dict[str, Any]) -> None:
    """Raises ValueError for the first field whose math this model lacks."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise _refuse("quantization_config", method or quantization,
                      "weights must be unquantized")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "the MLP is SwiGLU (silu)")
    if raw.get("mlp_bias"):
        raise _refuse("mlp_bias", raw["mlp_bias"], "MLP projections have no bias")
    # Qwen2 always has q/k/v biases (and no o_proj bias); Llama's attention_bias
    # would add all four, o_proj's included, which is not implemented.
    if model_type == "llama" and raw.get("attention_bias"):
        raise _refuse("attention_bias", raw["attention_bias"],
                      "q/k/v/o biases on Llama are not implemented")
    if raw.get("use_sliding_window"):
        raise _refuse("use_sliding_window", raw["use_sliding_window"],
                      "attention is full causal (sliding windows are not implemented)")
    windowed = [t for t in _get(raw, "layer_types", list, None) or ()
                if t != "full_attention"]
    if windowed:
        raise _refuse("layer_types", windowed[0], "every layer must be full_attention")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", raw["partial_rotary_factor"],
                      "RoPE is applied to the whole head")


def eos_token_ids(*raws: Any) -> tuple[int, ...]:
    """Every eos id of the given `eos_token_id` values (int, list or None), in
    order, without repeats: a chat model often ends turns with a second one
    that only generation_config.json lists."""
    ids: list[int] = []
    for raw in raws:
        tokens = [] if raw is None else [raw] if type(raw) is int else raw
        if type(tokens) is not list or any(type(t) is not int for t in tokens):
            raise ValueError(f"eos_token_id={raw!r}: expected a token id or a list of them")
        ids += [t for t in dict.fromkeys(tokens) if t not in ids]
    return tuple(ids)


def checkpoint_dtype(raw: dict[str, Any]) -> str | None:
    """The dtype the checkpoint declares (`dtype` since transformers 5, else
    `torch_dtype`), or None when it declares none."""
    for field in ("dtype", "torch_dtype"):
        name = raw.get(field)
        if name is None:
            continue
        if name not in CHECKPOINT_DTYPES:
            raise _refuse(field, name, f"--dtype auto takes one of {CHECKPOINT_DTYPES}; "
                                       "pass --dtype explicitly")
        return str(name)
    return None


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None
                       ) -> ModelConfig:
    """A Hugging Face `config.json` (as a dict) -> ModelConfig; `generation` is
    `generation_config.json`, whose eos ids are added to config.json's."""
    check_supported(raw)
    num_heads = _get(raw, "num_attention_heads", int)
    hidden_size = _get(raw, "hidden_size", int)
    head_dim = _get(raw, "head_dim", int, None)
    if head_dim is None and hidden_size % num_heads:
        raise _refuse("hidden_size", hidden_size, f"not a multiple of num_attention_heads "
                                                  f"{num_heads}, and no head_dim given")
    max_len = _get(raw, "max_position_embeddings", int, 2048)
    rope = _rope_parameters(raw)
    return ModelConfig(
        vocab_size=_get(raw, "vocab_size", int),
        hidden_size=hidden_size,
        intermediate_size=_get(raw, "intermediate_size", int),
        num_layers=_get(raw, "num_hidden_layers", int),
        num_heads=num_heads,
        num_kv_heads=_get(raw, "num_key_value_heads", int, None) or num_heads,
        head_dim=head_dim or hidden_size // num_heads,
        rope_theta=rope["rope_theta"],
        rms_norm_eps=float(_get(raw, "rms_norm_eps", float, 1e-6)),
        max_model_len=max_len,
        # null, as transformers reads it: not tied
        tie_word_embeddings=bool(_get(raw, "tie_word_embeddings", bool, None)),
        attention_bias=raw["model_type"] == "qwen2",
        eos_token_ids=eos_token_ids(raw.get("eos_token_id"),
                                    (generation or {}).get("eos_token_id")),
        rope_scaling=_rope_scaling(rope, max_len),
        model_type=raw["model_type"],
    )


def served_name(directory: Path) -> str:
    """The model's name as clients send it: its directory's (`--model .` is
    named too), but ORG/NAME for a Hugging Face Hub cache snapshot,
    .../models--ORG--NAME/snapshots/<revision hash>, not the hash (the Hub
    writes a repo id's "/" as "--", which no repo name may hold)."""
    path = Path(os.path.abspath(directory))
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return path.name
