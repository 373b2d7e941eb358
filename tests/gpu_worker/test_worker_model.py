"""Paged model vs plain causal attention, batch invariance, chunking, block copies."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from gpu_worker import elementwise
from gpu_worker.batched import rotary_table, rotate
from gpu_worker.config import tiny_model_config
from gpu_worker.invariance import choose_forward
from gpu_worker.model import apply_rotary, build_tiny_model
from gpu_worker.products import k_pieces, linear, stored_transposed
from gpu_worker.runner import SeqWork
from gpu_worker.sampling import GREEDY, SamplingParams
from gpu_worker.transfer import byte_view
from tests.gpu_worker.oracle import forward, reference_forward
from tests.gpu_worker.worker_factories import (
    BLOCK_SIZE,
    blocks_for,
    greedy_generate,
    make_runner,
    prompt,
    tiny_model,
)

PROMPT = prompt("The quick brown fox jumps over the lazy dog.")


def test_paged_prefill_and_decode_match_reference() -> None:
    runner = make_runner(torch.float32)
    # A scattered, non-monotonic block table: paging must not assume contiguity.
    table = [17, 3, 40, 8, 22, 1, 30, 12, 5, 60, 9, 44, 2, 33, 50, 7, 25, 6, 11]
    out = greedy_generate(runner, PROMPT, 24, table)
    full = torch.tensor(PROMPT + out)
    ref = reference_forward(tiny_model(torch.float32), full)
    paged = forward(runner, SeqWork("r", list(full[:-1]), 0, table), all_logits=True)
    torch.testing.assert_close(paged, ref[:-1], atol=1e-4, rtol=1e-4)
    batched = runner.logits([SeqWork("r", PROMPT, 0, table)])  # the batched path, too
    torch.testing.assert_close(batched[0], ref[len(PROMPT) - 1], atol=1e-4, rtol=1e-4)
    ref_greedy = ref[len(PROMPT) - 1:-1].argmax(-1).tolist()
    assert ref_greedy == out
    assert len(set(out)) > 3, f"tiny model output is degenerate: {out}"


def test_decode_is_bitwise_batch_invariant() -> None:
    """Each request's twin runs alone on another runner; in the batched runner the
    three share every step, in changing order. Logits and draws (greedy and
    seeded) agree bit for bit."""
    alone, batched = make_runner(), make_runner()
    requests = {"a": PROMPT, "b": prompt("kvstash stashes KV"), "c": prompt("x" * 29)}
    tables = {"a": blocks_for(64, 0), "b": blocks_for(64, 20), "c": blocks_for(64, 40)}
    params = {"a": GREEDY, "b": SamplingParams(max_tokens=16, temperature=0.8, seed=7),
              "c": SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=3)}
    last: dict[str, int] = {}
    for rid, ids in requests.items():
        seq = SeqWork(rid, ids, 0, tables[rid], True, params[rid])
        [last[rid]] = batched.execute([seq])
        assert alone.execute([seq]) == [last[rid]]
    pos = {rid: len(ids) for rid, ids in requests.items()}
    for step in range(12):
        seqs = {rid: SeqWork(rid, [last[rid]], pos[rid], tables[rid], True, params[rid])
                for rid in requests}
        order = ["b", "a", "c"] if step % 2 else ["c", "b", "a"]
        # Recomputing a position rewrites its KV with identical values, so the
        # extra logits() calls here change nothing for the steps that follow.
        batched_logits = dict(zip(order, batched.logits([seqs[r] for r in order]), strict=True))
        batched_tokens = dict(zip(order, batched.execute([seqs[r] for r in order]), strict=True))
        for rid in requests:
            assert torch.equal(alone.logits([seqs[rid]])[0], batched_logits[rid])
            [token_alone] = alone.execute([seqs[rid]])
            assert token_alone == batched_tokens[rid]
            assert token_alone is not None
            last[rid] = token_alone
            pos[rid] += 1
    for rid in requests:
        blocks = torch.tensor(tables[rid])
        assert torch.equal(alone.kv_cache[:, :, blocks], batched.kv_cache[:, :, blocks])


@pytest.mark.parametrize("chunk", [5, 16, 1])
def test_chunked_prefill_matches_full_in_float64(chunk: int) -> None:
    full_runner, chunked_runner = make_runner(torch.float64), make_runner(torch.float64)
    table = blocks_for(len(PROMPT) + 32)
    full_out = greedy_generate(full_runner, PROMPT, 32, table)
    chunked_out = greedy_generate(chunked_runner, PROMPT, 32, table, chunk=chunk)
    assert chunked_out == full_out
    seq = SeqWork("r", [full_out[-1]], len(PROMPT) + 31, table)
    diff = (forward(full_runner, seq) - forward(chunked_runner, seq)).abs().max().item()
    assert diff < 1e-10


def test_gather_scatter_round_trip_continues_identically() -> None:
    runner, reference = make_runner(), make_runner()
    old_table = blocks_for(len(PROMPT) + 40, first=0)
    new_table = blocks_for(len(PROMPT) + 40, first=len(old_table) + 3)[::-1]
    first = greedy_generate(runner, PROMPT, 8, old_table)
    assert greedy_generate(reference, PROMPT, 8, old_table) == first
    used = old_table[: -(-(len(PROMPT) + 7) // BLOCK_SIZE)]
    host = runner.gather_blocks(used)
    assert host.shape == (4, 2, len(used), BLOCK_SIZE, 2, 32) and host.is_contiguous()
    runner.kv_cache[:, :, torch.tensor(used)] = float("nan")  # the old blocks are gone
    runner.scatter_blocks(new_table[: len(used)], host)
    pos, token_moved, token_ref = len(PROMPT) + 7, first[-1], first[-1]
    for _ in range(16):
        moved = SeqWork("r", [token_moved], pos, new_table, True)
        stayed = SeqWork("r", [token_ref], pos, old_table, True)
        assert torch.equal(forward(runner, moved), forward(reference, stayed))
        [token_moved] = runner.execute([moved])
        [token_ref] = reference.execute([stayed])
        assert token_moved == token_ref
        pos += 1


def test_gather_and_scatter_reject_bad_blocks() -> None:
    runner = make_runner(num_blocks=8)
    with pytest.raises(ValueError, match=r"block ids \[8\] outside \[0, 8\)"):
        runner.gather_blocks([1, 8])
    with pytest.raises(ValueError, match="repeat"):
        runner.scatter_blocks([1, 1], runner.empty_host_blocks(2))
    with pytest.raises(ValueError, match=r"want torch\.float32"):
        runner.scatter_blocks([1, 2], runner.empty_host_blocks(3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_block_bytes_round_trip_in_every_dtype(dtype: torch.dtype) -> None:
    runner = make_runner(dtype, num_blocks=8)
    runner.execute([SeqWork("r", PROMPT[:12], 0, [2, 5, 1])])
    host = runner.gather_blocks([2, 5, 1])
    raw = bytes(byte_view(host))
    assert len(raw) == 3 * 4 * 2 * BLOCK_SIZE * 2 * 32 * host.element_size()
    back = runner.empty_host_blocks(3)
    byte_view(back)[:] = raw
    runner.scatter_blocks([0, 3, 4], back)
    assert torch.equal(runner.kv_cache[:, :, [0, 3, 4]], runner.kv_cache[:, :, [2, 5, 1]])
    assert runner.kv_cache[:, :, 2].abs().sum() > 0


def test_batched_rotary_is_apply_rotary_bit_for_bit() -> None:
    model = tiny_model(torch.float32)
    positions = torch.arange(0, 1000, 7)
    cos, sin = model.rotary(positions)
    table_cos, signed_sin = rotary_table(model, 1000)
    x = torch.randn(len(positions), 6, model.config.head_dim)
    assert torch.equal(rotate(x, table_cos[positions], signed_sin[positions]),
                       apply_rotary(x, cos, sin))


@pytest.fixture
def three_threads() -> Iterator[None]:
    """Three intra-op threads (on any number of cores): torch then cuts
    element-wise ranges over 32,768 elements in thirds, mid-row."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


CUTS = ((0, 1), (3, 40), (17, 4999), (1, 5000), (0, 2000), (100, 3100))


@pytest.mark.usefixtures("three_threads")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_exp_and_silu_give_an_element_the_same_bits_at_any_size(dtype: torch.dtype) -> None:
    """Whole steps put a row anywhere in tensors of any size: every cut of the
    same rows agrees, also with the rows apart (gate_up's gate half)."""
    width = 2 * elementwise.span(dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5000, width, generator=gen, dtype=torch.float64).mul(4).to(dtype)
    for fn in (elementwise.exp_, elementwise.silu_):
        whole = fn(x.clone())
        for start, stop in CUTS:
            assert torch.equal(fn(x[start:stop].clone()), whole[start:stop])
        assert torch.equal(fn(torch.cat((x, x), dim=1)[:, :width]), whole)


@pytest.mark.usefixtures("three_threads")
def test_plain_exp_and_silu_do_not() -> None:
    """What the test above would see without them."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5000, 2 * elementwise.span(torch.float32), generator=gen).mul(4)
    differ = sum(not torch.equal(fn(x[start:stop]), fn(x)[start:stop])
                 for fn in (torch.exp, F.silu) for start, stop in CUTS)
    assert differ > 0


@pytest.mark.parametrize("stored_in_out", [True, False])
def test_linear_in_k_pieces_is_the_product_and_row_invariant(stored_in_out: bool) -> None:
    """products.linear with k_pieces: the same product (float64: to rounding), and
    a row's bits the same at every row count that is a multiple of 4, for a
    K (1536) that MKL itself splits by row count. Laid out [in, out], on
    every CPU seen; [out, in] (a tied output head), on an AVX-512 Xeon's MKL
    but not an AMD EPYC's: whole steps multiply such a head from a copy laid
    out [in, out] (batched.py), so a tied model passes the start-up check
    on both."""
    gen = torch.Generator().manual_seed(0)
    out_features, k = 384, 1536
    if stored_in_out:
        weight = stored_transposed(out_features, k, torch.float64, torch.device("cpu"))
        weight.copy_(torch.randn(out_features, k, generator=gen, dtype=torch.float64))
    else:
        weight = torch.randn(out_features, k, generator=gen, dtype=torch.float64)
    bias = torch.randn(out_features, generator=gen, dtype=torch.float64)
    x = torch.randn(2, 128, k, generator=gen, dtype=torch.float64)
    assert torch.allclose(linear(x, weight, bias, k_pieces), F.linear(x, weight, bias))
    x32, w32 = x[0].float(), weight.float()
    first = linear(x32[:4], w32, None, k_pieces)
    differ = [rows for rows in range(8, 129, 4)
              if not torch.equal(linear(x32[:rows], w32, None, k_pieces)[:4], first)]
    if stored_in_out or not differ:
        assert differ == []
        return
    tied = dataclasses.replace(tiny_model_config(), tie_word_embeddings=True)
    model = build_tiny_model(tied, 0, torch.float32, torch.device("cpu"))
    assert choose_forward(model, 16, 1024, True, None, None).whole


def test_fused_projections_are_the_checkpoint_weights() -> None:
    """One matmul for q, k, v (and gate, up): the parts keep their checkpoint
    names and are views into the stacked weight, not copies."""
    model = tiny_model(torch.float32)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    names = set(model.state_dict())
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= names
    assert not any("qkv" in name or "gate_up" in name for name in names)
    x = torch.randn(4, model.config.hidden_size)
    assert torch.equal(attn.qkv(x), torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)],
                                              dim=1))
    assert attn.k_proj.weight.data_ptr() == attn.qkv.weight[attn.q_proj.weight.shape[0]:].data_ptr()
    assert torch.equal(mlp.gate_up(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=1))
