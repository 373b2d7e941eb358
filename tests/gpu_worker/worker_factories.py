"""Factories shared by the worker tests: tiny runners and a minimal greedy loop."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_worker.config import tiny_model_config
from gpu_worker.model import CausalLM, build_tiny_model
from gpu_worker.runner import ModelRunner, SeqWork
from gpu_worker.sampling import GREEDY, SamplingParams

BLOCK_SIZE = 4
_MODELS: dict[torch.dtype, CausalLM] = {}


def tiny_model(dtype: torch.dtype = torch.float32) -> CausalLM:
    """One model per dtype for the whole session: weights are read-only."""
    if dtype not in _MODELS:
        _MODELS[dtype] = build_tiny_model(tiny_model_config(), seed=0, dtype=dtype, device="cpu")
    return _MODELS[dtype]


def make_runner(dtype: torch.dtype = torch.float32, num_blocks: int = 64,
                block_size: int = BLOCK_SIZE) -> ModelRunner:
    return ModelRunner(tiny_model(dtype), block_size=block_size, num_blocks=num_blocks)


def prompt(text: str) -> list[int]:
    return list(text.encode())


def blocks_for(num_tokens: int, first: int = 0, block_size: int = BLOCK_SIZE) -> list[int]:
    return list(range(first, first + -(-num_tokens // block_size)))


def greedy_generate(runner: ModelRunner, prompt_ids: Sequence[int], num_tokens: int,
                    block_ids: Sequence[int], chunk: int | None = None,
                    sampling: SamplingParams = GREEDY) -> list[int]:
    """Prefill (in chunks of `chunk` tokens, or whole), then decode one token a step."""
    chunk = chunk or len(prompt_ids)
    token: int | None = None
    for start in range(0, len(prompt_ids), chunk):
        piece = list(prompt_ids[start:start + chunk])
        last = start + len(piece) == len(prompt_ids)
        [token] = runner.execute([SeqWork("r", piece, start, block_ids, last, sampling)])
    assert token is not None
    out = [token]
    while len(out) < num_tokens:
        pos = len(prompt_ids) + len(out) - 1
        [token] = runner.execute([SeqWork("r", [out[-1]], pos, block_ids, True, sampling)])
        assert token is not None
        out.append(token)
    return out
