"""The oracle's other side: the worker's model run directly, without paging,
batching, chunking or any service in between."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch

from gpu_worker.config import tiny_model_config
from gpu_worker.model import CausalLM, build_tiny_model
from kvstash.stack import StackConfig


@cache
def _model() -> CausalLM:
    defaults = StackConfig()
    dtype = getattr(torch, defaults.dtype)
    return build_tiny_model(tiny_model_config(), seed=0, dtype=dtype, device="cpu")


@cache
def _greedy(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        logits = _model().reference_forward(torch.tensor(tokens))
        tokens.append(int(logits[-1].argmax()))
    return tuple(tokens[len(prompt):])


def reference_greedy(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the stack's default tiny model, EOS ignored."""
    return list(_greedy(tuple(prompt), max_tokens))
