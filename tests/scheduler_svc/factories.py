"""Factory helpers shared by the scheduler core's tests."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from kvstash.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.outputs import (
    OffloadCommand,
    RequestUpdate,
    RestoreCommand,
    SchedulerOutput,
)
from scheduler_svc.core.scheduler import Scheduler

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
