"""Factory helpers shared by the scheduler core's tests."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from kvstash.common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.costs import CostModel
from scheduler_svc.core.outputs import (
    OffloadCommand,
    RequestUpdate,
    RestoreCommand,
    SchedulerOutput,
)
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.seq import ScheduledSeq

EOS = 0

# The latest copy command each scheduler issued per request, recorded by step().
_COPIES: weakref.WeakKeyDictionary[Scheduler, dict[str, OffloadCommand | RestoreCommand]] = (
    weakref.WeakKeyDictionary())


def make_config(**overrides: object) -> SchedulerConfig:
    values: dict[str, object] = {
        "num_blocks": 64,
        "block_size": 4,
        "max_model_len": 256,
        "vocab_size": 100,
        "eos_token_ids": (EOS,),
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
    }
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def make_scheduler(**overrides: object) -> Scheduler:
    return Scheduler(make_config(**overrides))


def add(
    scheduler: Scheduler,
    request_id: str,
    prompt_len: int = 4,
    max_tokens: int = 8,
    first_token: int = 10,
    **sampling: object,
) -> None:
    prompt = [first_token + i for i in range(prompt_len)]
    scheduler.add_request(request_id, prompt, SamplingParams(max_tokens, **sampling))  # type: ignore[arg-type]


def step(
    scheduler: Scheduler, token_id: int = 1, tokens: dict[str, int] | None = None
) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    """One schedule() + update(), sampling `token_id` (or tokens[request_id]) for everyone."""
    output = scheduler.schedule()
    sampled = {
        seq.request_id: (tokens or {}).get(seq.request_id, token_id)
        for seq in output.seqs
        if seq.sample
    }
    copies = _COPIES.setdefault(scheduler, {})
    commands: list[OffloadCommand | RestoreCommand] = [*output.offloads, *output.restores]
    for command in commands:
        copies[command.request_id] = command
    updates = scheduler.update(output, sampled)
    scheduler.check_integrity()
    return output, updates


def finish_offload(scheduler: Scheduler, request_id: str, num_bytes: int | None) -> None:
    """Lands the offload step() saw issued for request_id."""
    command = _COPIES[scheduler][request_id]
    assert isinstance(command, OffloadCommand)
    scheduler.finish_offload(command, num_bytes)


def finish_restore(scheduler: Scheduler, request_id: str, num_bytes: int | None) -> None:
    """Lands the restore step() saw issued for request_id."""
    command = _COPIES[scheduler][request_id]
    assert isinstance(command, RestoreCommand)
    scheduler.finish_restore(command, num_bytes)


def ids(seqs: Sequence[object]) -> list[str]:
    return [seq.request_id for seq in seqs]  # type: ignore[attr-defined]


def run_to_end(scheduler: Scheduler) -> None:
    """Steps until every request finished (offloads and restores must be
    answered by the caller first)."""
    while scheduler.has_unfinished_requests:
        step(scheduler)


# Prefill chunks (start, length) of the steps teach_costs shows: varied, so
# that the step model's per-token and per-token-squared rates are told apart.
TAUGHT_CHUNKS = ((0, 8), (0, 64), (8, 24), (100, 30), (300, 1), (40, 200), (0, 16), (64, 64))


def prefill_step(start: int, length: int) -> list[ScheduledSeq]:
    return [ScheduledSeq("x", [1] * length, start, [], False, SamplingParams(1))]


def teach_costs(
    costs: CostModel, offload: tuple[float, float], restore: tuple[float, float],
    prefill: tuple[float, float], step_s: float = 0.002,
) -> None:
    """Measurements made exactly of these rates: offload and restore
    (fixed s, s per block), prefill (a, b: a * L + b * L^2 s), on top of a
    fixed step_s per step; enough of each to be trusted."""
    for num_blocks in range(1, 9):
        costs.observe_offload(num_blocks, offload[0] + offload[1] * num_blocks)
        costs.observe_restore(num_blocks, restore[0] + restore[1] * num_blocks)
    a, b = prefill
    for start, length in TAUGHT_CHUNKS:
        end = start + length
        costs.observe_step(prefill_step(start, length), 0,
                           step_s + a * length + b * (end * end - start * start))
