"""The tiny model writes only printable text and EOS (ModelConfig.output_token_ids):
every other logit is the dtype's lowest, so no greedy choice or sampled draw
picks one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_worker.config import tiny_model_config
from gpu_worker.model import CausalLM, Linear, OutputHead
from gpu_worker.runner import SeqWork
from gpu_worker.sampling import SamplingParams
from kvstash.common.tokenizer import BYTE_EOS_ID, TINY_TEXT_IDS, ByteTokenizer
from tests.gpu_worker.worker_factories import (
    blocks_for,
    greedy_generate,
    make_runner,
    prompt,
    tiny_model,
)

ALLOWED = {*TINY_TEXT_IDS, BYTE_EOS_ID}
PROMPTS = [prompt("hello kv"), prompt("héllo 🙂"), list(range(0, 256, 7)), [256, 1, 2, 3]]


def test_the_tiny_config_names_printable_text_and_eos() -> None:
    assert set(tiny_model_config().output_token_ids or ()) == ALLOWED


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_every_other_logit_is_the_dtypes_lowest(dtype: torch.dtype) -> None:
    runner = make_runner(dtype)
    seqs = [SeqWork(f"r{i}", p, 0, blocks_for(len(p), 16 * i)) for i, p in enumerate(PROMPTS)]
    logits = runner.logits(seqs)
    lowest = logits == torch.finfo(dtype).min
    for row in range(len(PROMPTS)):
        assert set((~lowest[row]).nonzero().flatten().tolist()) == ALLOWED
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=48, temperature=5.0, seed=1),
    SamplingParams(max_tokens=48, temperature=2.0, top_k=200, seed=2),
    SamplingParams(max_tokens=48, temperature=3.0, top_p=0.999, seed=3),
    SamplingParams(max_tokens=48, temperature=1e6, seed=4),  # all allowed ones alike
])
def test_hot_sampling_writes_text_that_re_tokenizes_to_itself(
        sampling: SamplingParams) -> None:
    runner = make_runner(torch.float32, num_blocks=128)
    for i, ids in enumerate(PROMPTS[:2]):
        out = greedy_generate(runner, ids, 40, blocks_for(len(ids) + 40, 32 * i),
                              sampling=sampling)
        assert set(out) <= ALLOWED, sorted(set(out) - ALLOWED)
        text = [t for t in out if t != BYTE_EOS_ID]
        assert ByteTokenizer().encode(ByteTokenizer().decode(text)) == text


def test_a_model_without_output_ids_keeps_a_plain_head() -> None:
    """Checkpoints: every token stays possible and nothing is added to the weights."""
    cfg = dataclasses.replace(tiny_model_config(), output_token_ids=None)
    model = CausalLM(cfg)
    assert type(model.lm_head) is Linear
    assert isinstance(tiny_model().lm_head, OutputHead)
    assert set(tiny_model().state_dict()) == set(model.state_dict())


@pytest.mark.parametrize(("ids", "message"), [
    ((), "output_token_ids is empty"),
    ((5, 258, -1), r"output_token_ids \[258, -1\] outside vocab of 258"),
])
def test_bad_output_ids_are_refused(ids: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(tiny_model_config(), output_token_ids=ids)
