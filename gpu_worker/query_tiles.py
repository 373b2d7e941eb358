"""How the torch attention path cuts a step's query rows into tiles, and
where each tile's keys are: planned on the host, once per step.

    sequences  a: prefill rows at 8..10    b: decode at 21    c: decode at 4
    tiles      [ a8 a9 a10 pad ]           [ b21 pad ]        [ c4 pad ]
               (large = 4: a has more than `small` rows)   (small = 2)
    keys       a: slots of 0..10, b: of 0..21, c: of 0..4, in chunks of C from 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.step_inputs import HostStep

# Rows a CPU GEMM (MKL, oneDNN) computes together: at any row count that is a
# multiple of it a row gets the same bits (checked at start: invariance.py).
GEMM_ROW_PANEL = 4


@dataclass(frozen=True, slots=True)
class QueryTiles:
    """How the torch path cuts a step's query rows into tiles of one sequence.

    A sequence with at most `small` rows (a decode, a short chunk) takes one
    tile of `small` rows; a longer one, tiles of `large`. With `small` ==
    `large` every matmul has one shape whatever the step: invariant by
    construction. With `large` > `small` (the default where the start-up
    check passed) the two tile sizes give a row the same bits because the
    matmul does at every row count that is a multiple of `GEMM_ROW_PANEL`;
    both sizes times the heads per KV head are such multiples."""

    small: int
    large: int

    @staticmethod
    def for_heads(group: int, fixed: bool, large_rows: int = 256) -> QueryTiles:
        """`group` query heads per KV head; `fixed`: one tile size."""
        small = GEMM_ROW_PANEL // math.gcd(GEMM_ROW_PANEL, group)
        if fixed:
            return QueryTiles(small, small)
        return QueryTiles(small, max(small, large_rows // group // small * small))


@dataclass(frozen=True, slots=True)
class TileGroup:
    """The tiles of one size in a step and the (tile, key chunk) pairs they
    read: chunk j of tile t for every j up to its last row's position. Pairs
    whose keys every row of the tile reads come first, those that need a mask
    last; either way a tile's pairs stay in chunk order (a tile's masked
    chunks are its last ones).

    Indexes are rows of [rows * heads, d] views (one head's vector a row: a
    step's q, a cache plane [slots * kv_heads, d], the output), laid out as
    the products read and write them: [pairs or tiles, kv heads, m, ...] with
    m = tile rows x query heads per KV head."""

    rows: int  # per tile
    tiles: int
    pairs: int
    masked: int  # the last pairs, those `bias` is added to
    pair_tile: torch.Tensor  # [pairs] tile of each pair
    # [pairs * kv_heads * m] q row of each pair's query (padding: the tile's first row's)
    query_rows: torch.Tensor
    key_rows: torch.Tensor  # [pairs * kv_heads * C] cache row of each key (past the context: key 0)
    out_rows: torch.Tensor  # [tiles * kv_heads * m] output row (padding rows: the dump row's)
    # [masked pairs * kv_heads, m, C]: 0, or -inf where the key is past the
    # row's position; added to the scores of the last pairs.
    bias: torch.Tensor
    # Where index_add_ may add a tile's pairs in any order (CUDA: atomics):
    # for each chunk j, the pairs reading it and their tiles, so that a tile's
    # pairs are added one call per chunk, in chunk order. Empty on the CPU,
    # whose index_add_ runs through the indices in order.
    chunk_pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


def plan_tiles(host: HostStep, seqs: np.ndarray, rows: int, block_size: int, chunk: int,
               heads: tuple[int, int], dtype: torch.dtype, device: torch.device,
               by_chunk: bool = False) -> TileGroup:
    """The tiles of `rows` rows holding sequences `seqs` (host arrays only);
    `heads`: KV heads and query heads per KV head; `dtype`: the scores';
    `by_chunk`: plan `chunk_pairs` too."""
    lens = np.diff(host.query_start)[seqs]
    per_seq = -(-lens // rows)
    tile_seq = np.repeat(seqs, per_seq)
    index = np.arange(len(tile_seq)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    first = host.query_start[tile_seq] + index * rows  # [tiles]
    source = first[:, None] + np.arange(rows)  # [tiles, rows]
    real = source < host.query_start[tile_seq + 1][:, None]
    source = np.where(real, source, first[:, None])
    positions = host.positions[source]
    reads = positions.max(axis=1) // chunk + 1  # chunks each tile reads
    pair_tile = np.repeat(np.arange(len(reads)), reads)
    pair_chunk = np.arange(len(pair_tile)) - np.repeat(np.cumsum(reads) - reads, reads)
    # A pair needs a mask where its last key is past the tile's first position.
    masked = (pair_chunk + 1) * chunk > positions.min(axis=1)[pair_tile] + 1
    order = np.argsort(masked, kind="stable")
    pair_tile, pair_chunk = pair_tile[order], pair_chunk[order]
    plain = len(order) - int(masked.sum())
    keys = pair_chunk[:, None] * chunk + np.arange(chunk)  # [pairs, C] key positions
    seq = tile_seq[pair_tile]
    table = host.block_tables[seq]  # [pairs, table width]
    block = np.minimum(keys // block_size, table.shape[1] - 1)
    slots = np.take_along_axis(table, block, axis=1) * block_size + keys % block_size
    slots = np.where(keys < host.context_lens[seq][:, None], slots, table[:, :1] * block_size)
    kv_heads, group = heads
    # The bias is filled where it is used, from [masked, rows, C]: a GPU gets
    # the mask's bytes, not the bias's (kv_heads x group x 4 times as many).
    past = keys[plain:, None, :] > positions[pair_tile[plain:]][:, :, None]
    bias = torch.zeros(len(past), kv_heads, rows, group, chunk, dtype=dtype, device=device)
    bias.masked_fill_(torch.from_numpy(past).to(device)[:, None, :, None, :], float("-inf"))

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).reshape(-1)).to(device)

    # [1, kv, 1, group]: a head's row within a token's heads
    head = (np.arange(kv_heads)[:, None] * group + np.arange(group))[None, :, None, :]
    tile_rows = source[:, None, :, None] * (kv_heads * group) + head  # [tiles, kv, rows, group]
    dest = np.where(real, source, host.num_rows)
    chunk_pairs = tuple((tensor(np.flatnonzero(pair_chunk == j)),
                         tensor(pair_tile[pair_chunk == j]))
                        for j in range(int(reads.max()) if by_chunk else 0))
    pairs = tensor(pair_tile)
    # Each pair's query rows are its tile's, gathered where they are used (a
    # tile's rows once each over to a GPU, not once per chunk it reads).
    query_rows = tensor(tile_rows).view(len(reads), -1).index_select(0, pairs).view(-1)
    return TileGroup(rows, len(reads), len(pair_tile), len(past), pairs, query_rows,
                     tensor(slots[:, None, :] * kv_heads + np.arange(kv_heads)[None, :, None]),
                     tensor(dest[:, None, :, None] * (kv_heads * group) + head),
                     bias.view(-1, rows * group, chunk), chunk_pairs)
