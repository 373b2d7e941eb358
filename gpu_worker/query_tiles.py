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
    """The tiles of one size in a step, sorted by the chunks they read (most
    first), so the tiles reading chunk j are the first `active[j]`."""

    source: torch.Tensor  # [tiles * rows] query row of each tile row (padding: the tile's first)
    dest: torch.Tensor  # [tiles * rows] output row of each tile row (padding: the dump row)
    masks: torch.Tensor  # [tiles, rows, chunks * C] key position past the row's own
    key_slots: torch.Tensor  # [tiles * chunks * C] slot of each key (past the context: key 0)
    active: tuple[int, ...]  # per chunk: tiles reading it

    @property
    def shape(self) -> tuple[int, int, int]:
        """tiles, rows per tile, keys per tile."""
        tiles, rows, keys = self.masks.shape
        return tiles, rows, keys


def plan_tiles(host: HostStep, seqs: np.ndarray, rows: int, block_size: int, chunk: int,
               device: torch.device) -> TileGroup:
    """The tiles of `rows` rows holding sequences `seqs` (host arrays only)."""
    lens = np.diff(host.query_start)[seqs]
    per_seq = -(-lens // rows)
    tile_seq = np.repeat(seqs, per_seq)
    index = np.arange(len(tile_seq)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    first = host.query_start[tile_seq] + index * rows  # [tiles]
    source = first[:, None] + np.arange(rows)  # [tiles, rows]
    real = source < host.query_start[tile_seq + 1][:, None]
    source = np.where(real, source, first[:, None])
    positions = host.positions[source]
    last_chunk = positions.max(axis=1) // chunk
    order = np.argsort(-last_chunk, kind="stable")
    source, real, positions = source[order], real[order], positions[order]
    tile_seq = tile_seq[order]
    num_chunks = int(last_chunk.max()) + 1
    keys = np.arange(num_chunks * chunk)
    table = host.block_tables[tile_seq]  # [tiles, table width]
    block = np.minimum(keys // block_size, table.shape[1] - 1)
    slots = table[:, block] * block_size + keys % block_size
    slots = np.where(keys < host.context_lens[tile_seq][:, None], slots, table[:, :1] * block_size)
    dest = np.where(real, source, host.num_rows)
    active = tuple(int((last_chunk >= j).sum()) for j in range(num_chunks))

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return TileGroup(tensor(source.reshape(-1)), tensor(dest.reshape(-1)),
                     tensor(keys > positions[:, :, None]), tensor(slots.reshape(-1)), active)
