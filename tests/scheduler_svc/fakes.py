"""Fake worker and cache transport that check what the scheduler tells them.

The fake worker's KV cache stores, in every slot, the token whose KV it
would hold. Each step writes the scheduled tokens through the block table,
then reads back every position the step attends to and asserts it equals
the request's true prefix: a block reused while still holding someone's
KV, a wrong prefix hit, or a snapshot restored into the wrong place shows
up as a mismatch. The sampled token is a deterministic function of what was
read, so a wrong read would also change the generated tokens.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvstash.common.sampling import SamplingParams
from scheduler_svc.core.outputs import OffloadCommand, RestoreCommand, SchedulerOutput
from scheduler_svc.core.scheduler import Scheduler


def next_token(token_ids: Sequence[int], vocab_size: int) -> int:
    """The 'model': a hash of the whole prefix."""
    h = 0x345678
    for token_id in token_ids:
        h = ((h ^ (token_id + 1)) * 1000003) & 0xFFFFFFFF
    return (h >> 7) % vocab_size


def reference_output(
    prompt: Sequence[int], sampling: SamplingParams, eos_token_ids: Sequence[int], vocab_size: int
) -> list[int]:
    """What an unpressured run generates: the oracle."""
    stop = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids))
    tokens = list(prompt)
    output: list[int] = []
    while True:
        token_id = next_token(tokens, vocab_size)
        tokens.append(token_id)
        output.append(token_id)
        if token_id in stop or len(output) >= sampling.max_tokens:
            return output


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def write(self, block_ids: Sequence[int], start_pos: int, token_ids: Sequence[int]) -> None:
        size = self.block_size
        for i, token_id in enumerate(token_ids):
            pos = start_pos + i
            self.kv[block_ids[pos // size]][pos % size] = token_id

    def read(self, block_ids: Sequence[int], num_tokens: int) -> list[int | None]:
        size = self.block_size
        return [self.kv[block_ids[pos // size]][pos % size] for pos in range(num_tokens)]

    def execute(self, output: SchedulerOutput, truth: Mapping[str, list[int]]) -> dict[str, int]:
        sampled: dict[str, int] = {}
        for seq in output.seqs:
            tokens = truth[seq.request_id]
            end = seq.start_pos + len(seq.token_ids)
            assert seq.token_ids == tokens[seq.start_pos : end], (
                f"{seq.request_id}: scheduled {seq.token_ids} at {seq.start_pos}, "
                f"true tokens {tokens[seq.start_pos:end]}"
            )
            assert len(seq.block_ids) * self.block_size >= end, f"{seq.request_id}: table short"
            self.write(seq.block_ids, seq.start_pos, seq.token_ids)
            read = self.read(seq.block_ids, end)
            expected = tokens[:end]
            assert read == expected, f"{seq.request_id}: KV holds {read}, expected {expected}"
            if seq.sample:
                sampled[seq.request_id] = next_token(tokens[:end], self.vocab_size)
        return sampled


@dataclass
class _Copy:
    due_step: int
    command: OffloadCommand | RestoreCommand
    fails: bool


@dataclass
class FakeTransport:
    """Offload/restore copies that land (or fail) after random delays, into a
    cache that refuses puts beyond `capacity_bytes` (None: it is down) and
    deletes a snapshot once it is restored."""

    worker: FakeWorker
    rng: random.Random
    bytes_per_block: int
    fail_rate: float = 0.0
    max_delay: int = 3
    capacity_bytes: int | None = 10**12
    snapshots: dict[str, list[int | None]] = field(default_factory=dict)
    in_flight: list[_Copy] = field(default_factory=list)
    # Blocks offloads read from (shared prefix blocks may be read by several).
    reading: Counter[int] = field(default_factory=Counter)
    # Blocks restores write into: nobody else may touch them meanwhile.
    writing: set[int] = field(default_factory=set)
    num_offloads: int = 0
    num_restores: int = 0

    def submit(self, output: SchedulerOutput, step: int) -> None:
        for command in [*output.offloads, *output.restores]:
            overlap = self.writing.intersection(command.block_ids)
            assert not overlap, f"blocks {overlap} are being restored into"
            if isinstance(command, RestoreCommand):
                overlap = set(self.reading).intersection(command.block_ids)
                assert not overlap, f"restoring into blocks {overlap} an offload reads"
                self.writing.update(command.block_ids)
            else:
                self.reading.update(command.block_ids)
            delay = self.rng.randint(0, self.max_delay)
            self.in_flight.append(_Copy(step + delay, command, self.rng.random() < self.fail_rate))

    def check_not_busy(self, output: SchedulerOutput) -> None:
        """No step writes a block under a copy or reads one being restored into."""
        size = self.worker.block_size
        for seq in output.seqs:
            end = seq.start_pos + len(seq.token_ids)
            written = seq.block_ids[seq.start_pos // size : -(-end // size)]
            overlap = self.writing.intersection(seq.block_ids) | set(self.reading).intersection(
                written
            )
            assert not overlap, f"{seq.request_id} uses blocks {overlap} under a copy"

    def tick(self, scheduler: Scheduler, step: int, truth: Mapping[str, list[int]]) -> None:
        due = [c for c in self.in_flight if c.due_step <= step]
        self.in_flight = [c for c in self.in_flight if c.due_step > step]
        for copy in due:
            command = copy.command
            if isinstance(command, OffloadCommand):
                self.reading.subtract(command.block_ids)
                self.reading = +self.reading
                num_bytes = len(command.block_ids) * self.bytes_per_block
                if copy.fails or not self._fits(num_bytes):
                    scheduler.finish_offload(command, None)
                    continue
                tokens = self.worker.read(command.block_ids, command.num_tokens)
                expected = truth[command.request_id][: command.num_tokens]
                assert tokens == expected, f"snapshot of {command.request_id} is corrupt"
                assert command.snapshot_id not in self.snapshots
                self.snapshots[command.snapshot_id] = tokens
                self.num_offloads += 1
                scheduler.finish_offload(command, num_bytes)
            else:
                self.writing.difference_update(command.block_ids)
                if copy.fails:
                    # A half-finished copy leaves garbage behind.
                    for block_id in command.block_ids:
                        self.worker.kv[block_id] = [None] * self.worker.block_size
                    scheduler.finish_restore(command, None)
                    continue
                tokens = self.snapshots.pop(command.snapshot_id)  # a restore consumes it
                self.worker.write(command.block_ids, 0, [t for t in tokens if t is not None])
                self.num_restores += 1
                scheduler.finish_restore(command, len(command.block_ids) * self.bytes_per_block)

    def _fits(self, num_bytes: int) -> bool:
        """The cache's own admission: the one capacity answer."""
        if self.capacity_bytes is None:
            return False
        size = self.worker.block_size
        num_blocks = sum(-(-len(tokens) // size) for tokens in self.snapshots.values())
        return num_blocks * self.bytes_per_block + num_bytes <= self.capacity_bytes

    def delete(self, snapshot_ids: Sequence[str]) -> None:
        for snapshot_id in snapshot_ids:
            assert snapshot_id in self.snapshots, f"deleting unknown snapshot {snapshot_id}"
            del self.snapshots[snapshot_id]
