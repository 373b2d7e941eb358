"""Logits of loaded checkpoints against transformers' own Llama and Qwen2, in
float64, for config.json written by transformers 5 (`rope_parameters`) and in
the older layout (`rope_theta` and `rope_scaling` at the top level)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from gpu_worker.checkpoint import load_checkpoint
from tests.gpu_worker.oracle import forward_paged, reference_forward
from tests.gpu_worker.test_worker_checkpoint import tokenizer_json

# transformers computes rotary angles in float32 even in a float64 model, which
# leaves ~6e-7 of difference; reading the wrong theta leaves ~1.2, missing the
# Llama 3 scaling ~1.4, an rms_norm_eps of 1e-6 instead of 1e-5 ~2e-3.
TOLERANCE = 1e-5
TOKENS = [3, 17, 29, 4, 0, 38, 11, 12, 5, 7, 21, 33, 2, 9, 14, 26, 31, 8, 1, 19] * 5
SHAPE = {"vocab_size": 40, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4}


def llama() -> LlamaForCausalLM:
    # Theta far from the 10000 fallback, Llama 3 scaling that bends mid
    # frequencies at this length, GQA 4:1 and a head_dim of its own.
    config = LlamaConfig(**SHAPE, num_key_value_heads=1, head_dim=24, rms_norm_eps=1e-5,
                         max_position_embeddings=512, eos_token_id=1,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                          "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64})
    return LlamaForCausalLM(config)


def qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return Qwen2ForCausalLM(config)


def to_legacy_layout(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers 4 wrote it."""
    out = {k: v for k, v in raw.items() if k not in ("rope_parameters", "dtype", "layer_types")}
    rope = dict(raw["rope_parameters"])
    out["rope_theta"] = rope.pop("rope_theta")
    out["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    out["torch_dtype"] = raw["dtype"]
    return out


def save_reference(directory: Path, model: Any, legacy: bool,
                   max_shard_size: str = "50GB") -> torch.Tensor:
    """Random weights (biases too, which transformers zeroes), saved as
    transformers does; returns its float64 logits for TOKENS."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    (directory / "tokenizer.json").write_text(tokenizer_json())
    raw = json.loads((directory / "config.json").read_text())
    assert "rope_parameters" in raw and "rope_theta" not in raw  # the transformers-5 layout
    if legacy:
        (directory / "config.json").write_text(json.dumps(to_legacy_layout(raw)))
    model = model.to(torch.float64).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model(input_ids=torch.tensor([TOKENS])).logits[0]


@pytest.mark.parametrize("legacy", [False, True], ids=["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("build", [llama, qwen2], ids=["llama", "qwen2"])
def test_logits_match_transformers(tmp_path: Path, build: Any, legacy: bool) -> None:
    expected = save_reference(tmp_path, build(), legacy)
    loaded = load_checkpoint(tmp_path, torch.float64, torch.device("cpu"))
    got = reference_forward(loaded.model, torch.tensor(TOKENS))
    assert (got - expected).abs().max().item() < TOLERANCE
    # The paged path the runner uses agrees too (one 100-token prefill).
    cache = torch.zeros(2, 2, 8, 16, loaded.model.config.num_kv_heads,
                        loaded.model.config.head_dim, dtype=torch.float64)
    paged = forward_paged(loaded.model, torch.tensor(TOKENS), 0, cache, torch.arange(8),
                          all_logits=True)
    assert (paged - expected).abs().max().item() < TOLERANCE


def test_auto_dtype_is_the_checkpoints_own(tmp_path: Path) -> None:
    model = qwen2().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(tokenizer_json())
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_checkpoint(tmp_path, None, torch.device("cpu"))
    assert loaded.model.dtype == torch.bfloat16


def test_sharded_checkpoint_with_its_index_matches_transformers(tmp_path: Path) -> None:
    expected = save_reference(tmp_path, qwen2(), legacy=False, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_checkpoint(tmp_path, torch.float64, torch.device("cpu"))
    got = reference_forward(loaded.model, torch.tensor(TOKENS))
    assert (got - expected).abs().max().item() < TOLERANCE
