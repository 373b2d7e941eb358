"""The oracle's other side: the worker's model run directly on one sequence at
a time — no scheduler, no batching, no chunking, no preemption, no services."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch

from gpu_worker.config import tiny_model_config
from gpu_worker.model import build_tiny_model
from gpu_worker.runner import ModelRunner, SeqWork

_BLOCK_SIZE = 16


@cache
def _runner() -> ModelRunner:
    # What the stack's worker runs the tiny model in (its dtype "auto").
    dtype = torch.float64
    model = build_tiny_model(tiny_model_config(), seed=0, dtype=dtype, device="cpu")
    return ModelRunner(model, block_size=_BLOCK_SIZE, num_blocks=model.config.max_model_len
                       // _BLOCK_SIZE)


@cache
def _greedy(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    # One thread: the tiny model needs no more, and torch's pool (one per core)
    # spin-waits at every op for threads a loaded machine has descheduled
    # (a 2-core machine with services beside it took minutes, past the timeout).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _greedy_alone(prompt, max_tokens)
    finally:
        torch.set_num_threads(threads)


def _greedy_alone(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    runner = _runner()
    block_ids = list(range(-(-(len(prompt) + max_tokens) // _BLOCK_SIZE)))
    [token] = runner.execute([SeqWork("ref", prompt, 0, block_ids, sample=True)])
    assert token is not None
    out = [token]
    while len(out) < max_tokens:
        position = len(prompt) + len(out) - 1
        [token] = runner.execute([SeqWork("ref", [out[-1]], position, block_ids, sample=True)])
        assert token is not None
        out.append(token)
    return tuple(out)


def reference_greedy(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the stack's default tiny model, EOS ignored."""
    return list(_greedy(tuple(prompt), max_tokens))
