"""Packing a step (step_inputs) and the key slots attention reads (attention)."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker.attention import (
    AttentionBackend,
    PagedAttention,
    key_slots,
    packed_key_slots,
)
from gpu_worker.query_tiles import QueryTiles
from gpu_worker.runner import SeqWork
from gpu_worker.sampling import SamplingParams
from gpu_worker.step_inputs import StepStaging, pack_step

SEEDED = SamplingParams(max_tokens=4, temperature=1.0, seed=9)
# The picture in step_inputs' docstring: a prefill chunk at 8..10, decodes at 21 and 4.
STEP = [SeqWork("a", [5, 6, 7], 8, [3, 9, 4], False),
        SeqWork("b", [11], 21, [0, 1, 2, 7, 8, 10], True, SEEDED),
        SeqWork("c", [12], 4, [6, 5], True)]


def test_pack_step_lays_rows_out_as_documented() -> None:
    host = pack_step(STEP, block_size=4, row_tile=4, process_gen=torch.Generator())
    assert (host.num_tokens, host.num_rows, host.num_seqs) == (5, 8, 3)
    assert host.token_ids.tolist() == [5, 6, 7, 11, 12, 0, 0, 0]
    assert host.positions.tolist() == [8, 9, 10, 21, 4, 0, 0, 0]
    assert host.token_seq.tolist() == [0, 0, 0, 1, 2, 0, 0, 0]
    assert host.query_start.tolist() == [0, 3, 4, 5]
    assert host.context_lens.tolist() == [11, 22, 5]
    # position 8 of a: block 4 (table[2]) offset 0; b at 21: table[5] = 10, offset 1
    assert host.write_slots.tolist() == [16, 17, 18, 41, 20]
    assert host.block_tables.shape == (3, 6)
    assert host.block_tables[0].tolist() == [3, 9, 4, 0, 0, 0]  # unused -> block 0
    assert host.sample_rows.tolist() == [3, 4, 0, 0]  # padded to the tile, greedy padding
    assert host.num_sampled == 2
    assert host.sampling.temperature.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert host.max_query_len == 3 and host.max_context_len == 22


def test_pack_step_without_tile_pads_nothing() -> None:
    host = pack_step(STEP, block_size=4, row_tile=None, process_gen=torch.Generator())
    assert host.num_rows == 5 and len(host.sample_rows) == 2


def test_staging_reuses_one_buffer_and_grows_when_needed() -> None:
    staging = StepStaging(torch.device("cpu"), capacity=16)
    first = staging.stage(pack_step(STEP, 4, 4, torch.Generator()))
    assert first.positions.tolist() == [8, 9, 10, 21, 4, 0, 0, 0]
    assert first.sampling.temperature.dtype == torch.float64
    assert first.sampling.temperature.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert first.block_tables.tolist()[1] == [0, 1, 2, 7, 8, 10]
    big = [SeqWork(f"r{i}", [1] * 40, 0, list(range(10 * i, 10 * i + 10))) for i in range(8)]
    staged = staging.stage(pack_step(big, 4, 4, torch.Generator()))
    assert staged.token_ids.numel() == 320 and staged.context_lens.tolist() == [40] * 8
    again = staging.stage(pack_step(STEP, 4, 4, torch.Generator()))
    assert again.token_ids.data_ptr() == staged.token_ids.data_ptr()  # no new buffer


def test_key_slots_follow_block_tables() -> None:
    tables = torch.tensor([[3, 9, 4], [0, 1, 2]])
    slots = key_slots(tables, block_size=4, length=16)
    assert slots[0].tolist() == [12, 13, 14, 15, 36, 37, 38, 39, 16, 17, 18, 19, 0, 0, 0, 0]
    host = pack_step(STEP, 4, 4, torch.Generator())
    step = StepStaging(torch.device("cpu")).stage(host)
    all_slots = key_slots(step.block_tables, 4, 24)
    packed = packed_key_slots(step, all_slots).tolist()
    expected = [s for i, n in enumerate(host.context_lens.tolist())
                for s in all_slots[i, :n].tolist()]
    assert packed == expected and len(packed) == 11 + 22 + 5


@pytest.mark.parametrize("by_chunk", [False, True])
@pytest.mark.parametrize(("row_tile", "tiles"), [
    (4, QueryTiles(1, 1)),  # one tile size: a tile per row
    (4, QueryTiles(2, 2)),  # the prefill chunk of 3 rows spans two tiles
    (None, QueryTiles(1, 2)),  # decodes in tiles of 1, the chunk in tiles of 2
])
def test_torch_attention_matches_plain_softmax_and_ignores_stale_slots(
        row_tile: int | None, tiles: QueryTiles, by_chunk: bool) -> None:
    """Against a dense masked softmax per row, with keys in chunks of 8 (b at
    21 reads three); every slot a row must not read holds NaN, so a leak
    would show. by_chunk: tiles' pairs summed one index_add_ per chunk (as
    on a GPU)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    cache = torch.full((2, 12 * 4, kv_heads, dim), float("nan"), dtype=torch.float64)
    host = pack_step(STEP, 4, row_tile, torch.Generator())
    step = StepStaging(torch.device("cpu")).stage(host)
    for i in range(len(STEP)):
        slots = key_slots(step.block_tables[i:i + 1], 4, int(host.context_lens[i]))[0]
        cache[:, slots] = torch.randn(2, len(slots), kv_heads, dim, generator=gen,
                                      dtype=torch.float64)
    attention = PagedAttention(heads, kv_heads, dim, 4, AttentionBackend.TORCH, True, tiles,
                               kv_chunk=8, dtype=torch.float64, sum_by_chunk=by_chunk)
    q = torch.randn(host.num_rows, heads, dim, generator=gen, dtype=torch.float64)
    out = attention(q, cache, step, attention.prepare(step))
    for row in range(host.num_tokens):
        seq, pos = int(host.token_seq[row]), int(host.positions[row])
        slots = key_slots(step.block_tables[seq:seq + 1], 4, pos + 1)[0]
        keys = cache[0, slots].repeat_interleave(heads // kv_heads, dim=1)  # [T, heads, d]
        values = cache[1, slots].repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[row], keys) / math.sqrt(dim), -1)
        expected = torch.einsum("ht,thd->hd", weights, values)
        torch.testing.assert_close(out[row], expected, atol=1e-12, rtol=1e-12)


def test_summing_pairs_chunk_by_chunk_gives_index_add_s_bits() -> None:
    """A GPU's index_add_ adds a tile's pairs in any order (atomics), so
    there each chunk is added by its own call; that gives every row the bits
    of the CPU's one index_add_ in pair order, here with tiles reading up to
    eight chunks, masked and not, beside one-chunk decodes."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block = 8, 2, 16, 4
    seqs = [SeqWork("long", [1] * 6, 58, list(range(16))),  # chunks 0..7
            SeqWork("mid", [2] * 20, 10, list(range(16, 24))),
            *(SeqWork(f"d{i}", [3], 3 + 9 * i, list(range(24 + 10 * i, 34 + 10 * i)))
              for i in range(5))]
    host = pack_step(seqs, block, 4, torch.Generator())
    step = StepStaging(torch.device("cpu")).stage(host)
    cache = torch.randn(2, 80 * block, kv_heads, dim, generator=gen)
    q = torch.randn(host.num_rows, heads, dim, generator=gen)
    outs = []
    for by_chunk in (False, True):
        attention = PagedAttention(heads, kv_heads, dim, block, AttentionBackend.TORCH, True,
                                   QueryTiles(2, 8), kv_chunk=8, dtype=torch.float32,
                                   sum_by_chunk=by_chunk)
        keys = attention.prepare(step)
        assert all(bool(g.chunk_pairs) == by_chunk for g in keys.groups)
        outs.append(attention(q, cache, step, keys)[:host.num_tokens])
    assert max(len(g.chunk_pairs) for g in keys.groups) == 8
    assert torch.equal(outs[0], outs[1])
