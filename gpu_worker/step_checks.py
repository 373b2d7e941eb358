"""A step's sequences checked before any KV is written (ModelRunner.check_step):
a rejected step leaves the cache untouched and the stream usable.

    each sequence   tokens in the vocabulary, positions within max_model_len,
                    a block table long enough, its ids in the pool, none named
                    twice among those its positions use
    the step        no request twice; no KV slot written by two requests; no
                    block one request writes in another's table (requests
                    share only whole prefix blocks, which none of them writes)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpu_worker.step_inputs import StepSeq
from kvstash.errors import InvalidArgument


class CheckedSeq(StepSeq, Protocol):
    """A `runner.SeqWork`, as checked."""

    @property
    def request_id(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Limits:
    """What a step must fit: the runner's."""

    block_size: int
    num_blocks: int
    vocab_size: int
    max_model_len: int


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise InvalidArgument(f"{what}: block ids {bad[:8]} outside [0, {num_blocks})")


def check_step(seqs: Sequence[CheckedSeq], limits: Limits) -> None:
    """Every problem a step could hit (module docstring), InvalidArgument."""
    seen_requests: set[str] = set()
    for seq in seqs:
        if seq.request_id in seen_requests:
            raise InvalidArgument(f"request {seq.request_id!r} appears twice in one step")
        seen_requests.add(seq.request_id)
        _check_seq(seq, limits)
    used = [_used_blocks(seq, limits.block_size) for seq in seqs]
    slots = [_write_slots(seq, table, limits.block_size)
             for seq, table in zip(seqs, used, strict=True)]
    flat = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
    if len(np.unique(flat)) != len(flat):
        _raise_shared_slot(seqs, slots, limits.block_size)
    if len(seqs) > 1:
        _check_written_blocks_unshared(seqs, used, limits.block_size)


def _check_seq(seq: CheckedSeq, limits: Limits) -> None:
    who = f"request {seq.request_id!r}"
    n = len(seq.token_ids)
    if n == 0:
        raise InvalidArgument(f"{who}: no token_ids to compute")
    vocab = limits.vocab_size
    bad_tokens = [t for t in seq.token_ids if not 0 <= t < vocab]
    if bad_tokens:
        raise InvalidArgument(f"{who}: token ids {bad_tokens[:8]} outside vocab of {vocab}")
    end = seq.start_pos + n
    if seq.start_pos < 0 or end > limits.max_model_len:
        raise InvalidArgument(
            f"{who}: positions {seq.start_pos}..{end - 1} exceed max_model_len "
            f"{limits.max_model_len}"
        )
    block_size = limits.block_size
    need = -(-end // block_size)
    if len(seq.block_ids) < need:
        raise InvalidArgument(
            f"{who}: {end} positions need {need} blocks of {block_size}, "
            f"block table has {len(seq.block_ids)}"
        )
    check_block_ids(seq.block_ids, limits.num_blocks, who)
    used = seq.block_ids[:need]
    if len(set(used)) != need:  # one block for two places: each overwrites the other
        repeats = [b for b, k in Counter(used).items() if k > 1]
        raise InvalidArgument(
            f"{who}: block table names blocks {repeats[:8]} more than once in the "
            f"{need} blocks its {end} positions use")


def _used_blocks(seq: CheckedSeq, block_size: int) -> np.ndarray:
    """The block table entries a step reads or writes for `seq`."""
    end = seq.start_pos + len(seq.token_ids)
    return np.asarray(seq.block_ids[: -(-end // block_size)], dtype=np.int64)


def _write_slots(seq: CheckedSeq, table: np.ndarray, block_size: int) -> np.ndarray:
    """`table`: the sequence's _used_blocks."""
    pos = np.arange(seq.start_pos, seq.start_pos + len(seq.token_ids))
    return table[pos // block_size] * block_size + pos % block_size


def _raise_shared_slot(seqs: Sequence[CheckedSeq], slots: list[np.ndarray],
                       block_size: int) -> None:
    written: dict[int, str] = {}  # slot -> request writing it
    for seq, seq_slots in zip(seqs, slots, strict=True):
        for slot in seq_slots.tolist():
            other = written.setdefault(slot, seq.request_id)
            if other != seq.request_id:
                raise InvalidArgument(
                    f"requests {other!r} and {seq.request_id!r} both write block "
                    f"{slot // block_size} offset {slot % block_size}"
                )


def _check_written_blocks_unshared(seqs: Sequence[CheckedSeq], used: list[np.ndarray],
                                   block_size: int) -> None:
    """No block a sequence writes is in another's table this step. Requests
    share only whole prefix blocks, which none of them writes; a block given
    to two (a block pool's double allocation) would have one request's new KV
    overwrite the other's cached KV, or be read by it. `used`: each
    sequence's _used_blocks."""
    blocks, counts = np.unique(np.concatenate(used), return_counts=True)
    shared = blocks[counts > 1]  # tables hold no repeats (_check_seq)
    if not len(shared):
        return
    written = [table[seq.start_pos // block_size:] for seq, table in zip(seqs, used, strict=True)]
    if not np.isin(np.concatenate(written), shared).any():
        return
    for seq, seq_written in zip(seqs, written, strict=True):
        clash = seq_written[np.isin(seq_written, shared)]
        if len(clash):
            block = int(clash[0])
            other = next(o.request_id for o, t in zip(seqs, used, strict=True)
                         if o is not seq and block in t)
            raise InvalidArgument(
                f"request {seq.request_id!r} writes block {block}, which request "
                f"{other!r} also holds in this step (only whole prefix blocks, "
                "written by none, may be shared)")
