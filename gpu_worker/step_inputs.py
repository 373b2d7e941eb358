"""Step inputs: a list of SeqWork -> packed host arrays -> one copy to the device.

Every token of the step goes in one row order, sequence after sequence
(varlen packing), padded to a whole number of row tiles:

    seqs         a: prefill chunk at 8..10     b: decode at 21     c: decode at 4
    rows         [ a8  a9  a10 | b21 | c4 | pad ... pad ]     (rows = tiles * row_tile)
    query_start  [0, 3, 4, 5]                 row range of each sequence
    context_len  [11, 22, 5]                  keys each sequence has once this step wrote
    write_slot   block_table[pos // block_size] * block_size + pos % block_size, per real row
    sample_row   [2, 3, 4]                    last row of each sequence that samples

The host builds these with numpy into one preallocated int64 buffer (pinned
when the device is a GPU; float64 columns stored bit for bit), and one
non-blocking copy moves it. The buffer is reused step after step: before it is
overwritten, the previous copy out of it must have finished (an event on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Protocol

import numpy as np
import torch

from gpu_worker.sampling import GREEDY, DeviceSampling, SamplingBatch, SamplingParams


class StepSeq(Protocol):
    """What packing reads of a `runner.SeqWork`."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def start_pos(self) -> int: ...
    @property
    def block_ids(self) -> Sequence[int]: ...
    @property
    def sample(self) -> bool: ...
    @property
    def sampling(self) -> SamplingParams: ...


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, slots=True)
class HostStep:
    """One step, packed on the host. Row arrays have `num_rows` entries."""

    num_tokens: int  # real rows
    num_rows: int  # num_tokens rounded up to the row tile (>= 1 tile)
    token_ids: np.ndarray  # [num_rows]; padding rows read token 0
    positions: np.ndarray  # [num_rows]; padding rows sit at position 0
    token_seq: np.ndarray  # [num_rows] sequence index of each row; padding -> 0
    write_slots: np.ndarray  # [num_tokens] cache slot each real row writes
    query_start: np.ndarray  # [num_seqs + 1]
    context_lens: np.ndarray  # [num_seqs]
    block_tables: np.ndarray  # [num_seqs, max blocks needed]; unused entries -> block 0
    sample_rows: np.ndarray  # [num_sample_rows] (padded to the row tile with row 0)
    num_sampled: int  # real entries of sample_rows
    sampling: SamplingBatch  # one entry per sample_rows entry (padding greedy)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start).max())

    @property
    def max_context_len(self) -> int:
        return int(self.context_lens.max())


def pack_step(seqs: Sequence[StepSeq], block_size: int, row_tile: int | None,
              process_gen: torch.Generator) -> HostStep:
    """Trusts its input (the runner validated it). `row_tile` None = no padding."""
    lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
    starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
    query_start = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    num_rows = round_up(max(num_tokens, 1), row_tile) if row_tile else num_tokens
    context_lens = starts + lens
    num_table = max(1, -(-int(context_lens.max()) // block_size))
    tables = np.zeros((len(seqs), num_table), dtype=np.int64)
    for i, s in enumerate(seqs):
        used = min(len(s.block_ids), num_table)
        tables[i, :used] = s.block_ids[:used]
    token_seq = np.zeros(num_rows, dtype=np.int64)
    token_seq[:num_tokens] = np.repeat(np.arange(len(seqs)), lens)
    positions = np.zeros(num_rows, dtype=np.int64)
    positions[:num_tokens] = (np.arange(num_tokens) - query_start[:-1][token_seq[:num_tokens]]
                              + starts[token_seq[:num_tokens]])
    token_ids = np.zeros(num_rows, dtype=np.int64)
    token_ids[:num_tokens] = np.fromiter(chain.from_iterable(s.token_ids for s in seqs),
                                         dtype=np.int64, count=num_tokens)
    real_pos, real_seq = positions[:num_tokens], token_seq[:num_tokens]
    write_slots = tables[real_seq, real_pos // block_size] * block_size + real_pos % block_size
    sampled = [i for i, s in enumerate(seqs) if s.sample]
    num_sample_rows = round_up(len(sampled), row_tile) if row_tile and sampled else len(sampled)
    sample_rows = np.zeros(num_sample_rows, dtype=np.int64)
    sample_rows[:len(sampled)] = query_start[1:][sampled] - 1
    padding = num_sample_rows - len(sampled)
    params = [seqs[i].sampling for i in sampled] + [GREEDY] * padding
    draw_at = [int(context_lens[i]) for i in sampled] + [0] * padding
    return HostStep(num_tokens, num_rows, token_ids, positions, token_seq, write_slots,
                    query_start, context_lens, tables, sample_rows, len(sampled),
                    SamplingBatch.build(params, draw_at, process_gen))


@dataclass(frozen=True, slots=True)
class DeviceStep:
    """HostStep's arrays on the device (views into one staged buffer), plus the
    host-side sizes that kernels and loops need without reading the device."""

    host: HostStep
    token_ids: torch.Tensor
    positions: torch.Tensor
    token_seq: torch.Tensor
    write_slots: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    sample_rows: torch.Tensor
    sampling: DeviceSampling


class StepStaging:
    """The preallocated host buffer (pinned on CUDA) and its device twin.
    Grows (rarely: by doubling) when a step needs more than it holds."""

    def __init__(self, device: torch.device, capacity: int = 1 << 14) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._capacity = 0
        self._copied: torch.cuda.Event | None = None  # last copy out of the host buffer
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        self._wait_copy()
        self._capacity = 1 << math.ceil(math.log2(max(capacity, 1)))
        self._host = torch.empty(self._capacity, dtype=torch.int64, pin_memory=self._pinned)
        self._host_np = self._host.numpy()
        same = self.device.type == "cpu"
        self._device = self._host if same else torch.empty(self._capacity, dtype=torch.int64,
                                                           device=self.device)

    def _wait_copy(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def stage(self, step: HostStep) -> DeviceStep:
        s = step.sampling
        columns = [step.token_ids, step.positions, step.token_seq, step.write_slots,
                   step.query_start, step.context_lens, step.block_tables.reshape(-1),
                   step.sample_rows, s.temperature.view(np.int64), s.top_k,
                   s.top_p.view(np.int64), s.uniform.view(np.int64)]
        total = sum(c.size for c in columns)
        if total > self._capacity:
            self._grow(total)
        self._wait_copy()  # the previous step's copy may still read this buffer
        offsets = [0]
        for c in columns:
            self._host_np[offsets[-1]:offsets[-1] + c.size] = c
            offsets.append(offsets[-1] + c.size)
        if self._device is not self._host:
            self._device[:total].copy_(self._host[:total], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        views = [self._device[a:b] for a, b in pairwise(offsets)]
        tables = views[6].view(step.block_tables.shape)
        sampling = DeviceSampling(views[8].view(torch.float64), views[9],
                                  views[10].view(torch.float64), views[11].view(torch.float64),
                                  s.any_random, s.any_filter)
        return DeviceStep(step, views[0], views[1], views[2], views[3], views[4], views[5],
                          tables, views[7], sampling)
