"""Factory helpers shared by the scheduler core's tests."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.outputs import RequestUpdate, SchedulerOutput
from scheduler_svc.request import SamplingParams
from scheduler_svc.scheduler import Scheduler

EOS = 0


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
    updates = scheduler.update(output, sampled)
    scheduler.check_integrity()
    return output, updates


def ids(seqs: Sequence[object]) -> list[str]:
    return [seq.request_id for seq in seqs]  # type: ignore[attr-defined]


def run_to_end(scheduler: Scheduler) -> None:
    """Steps until every request finished (offloads and restores must be
    answered by the caller first)."""
    while scheduler.has_unfinished_requests:
        step(scheduler)
