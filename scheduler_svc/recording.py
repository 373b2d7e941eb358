"""A scheduler core that writes down every call the engine makes into it,
for `kvstash sim` to replay (kvstash/sim/replay.py): `--record-decisions`.

One JSON object per line, in call order, each with the core's clock `t`:

    config     the SchedulerConfig (first line)
    add        a request: id, prompt token ids, sampling
    schedule   what schedule() decided: each seq (id, start, tokens, sample),
               each preemption (id, mode), offload and restore (id, snapshot, blocks)
    step       observe_step's seconds
    update     the sampled tokens fed in, and the requests that finished
    offloaded / restored   a copy's outcome: snapshot, bytes (null: failed), seconds
    abort, cache (available or not), flush (the prefix cache forgotten)

Replayed in the same order with the same clock readings, a fresh core must
decide the same things: the record is every input the core has. Lines are
written as calls happen (line-buffered), so a killed process leaves a record
up to its last call. A MIXED instance only: a P/D one also takes calls the
edge makes into its PdManager, which this does not see.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstash.common.sampling import SamplingParams
from scheduler_svc.core.config import Role, SchedulerConfig
from scheduler_svc.core.outputs import (
    OffloadCommand,
    RequestUpdate,
    RestoreCommand,
    SchedulerOutput,
)
from scheduler_svc.core.request import Request, RequestUsage
from scheduler_svc.core.scheduler import Scheduler


def plain(value: Any) -> Any:
    """Enums by value, tuples as lists: what JSON holds and replays back."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def decisions(out: SchedulerOutput) -> dict[str, Any]:
    """What one schedule() decided, comparably."""
    return {
        "seqs": [[s.request_id, s.start_pos, len(s.token_ids), s.sample] for s in out.seqs],
        "preempted": [[p.request_id, p.mode.value] for p in out.preempted],
        "offloads": [[c.request_id, c.snapshot_id, len(c.block_ids)] for c in out.offloads],
        "restores": [[c.request_id, c.snapshot_id, len(c.block_ids)] for c in out.restores],
    }


def finished(updates: Sequence[RequestUpdate]) -> list[list[str]]:
    return [[u.request_id, u.finish_status.value] for u in updates
            if u.finish_status is not None]


class RecordingScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, path: Path,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.role is not Role.MIXED:
            raise ValueError(f"recording decisions is for a mixed instance, not {config.role}")
        super().__init__(config, clock=clock)
        self._file = path.open("w", buffering=1, encoding="utf-8")
        self._write("config", config=plain(dataclasses.asdict(config)))

    def _write(self, op: str, **fields: Any) -> None:
        self._file.write(json.dumps({"op": op, "t": self._clock(), **fields}) + "\n")

    def close(self) -> None:
        self._file.close()

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling: SamplingParams, *, handoff: bool = False) -> Request:
        req = super().add_request(request_id, prompt_token_ids, sampling, handoff=handoff)
        self._write("add", id=request_id, prompt=list(prompt_token_ids),
                    sampling=plain(dataclasses.asdict(sampling)))
        return req

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        self._write("schedule", step=out.step_id, decided=decisions(out))
        return out

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        super().observe_step(output, seconds)
        self._write("step", step=output.step_id, seconds=seconds)

    def update(self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int]
               ) -> list[RequestUpdate]:
        updates = super().update(output, sampled_token_ids)
        self._write("update", step=output.step_id, sampled=dict(sampled_token_ids),
                    finished=finished(updates))
        return updates

    def finish_offload(self, cmd: OffloadCommand, num_bytes: int | None,
                       seconds: float | None = None) -> None:
        super().finish_offload(cmd, num_bytes, seconds)
        self._write("offloaded", snapshot=cmd.snapshot_id, bytes=num_bytes, seconds=seconds)

    def finish_restore(self, cmd: RestoreCommand, num_bytes: int | None,
                       seconds: float | None = None) -> None:
        super().finish_restore(cmd, num_bytes, seconds)
        self._write("restored", snapshot=cmd.snapshot_id, bytes=num_bytes, seconds=seconds)

    def abort(self, request_id: str) -> RequestUsage:
        usage = super().abort(request_id)
        self._write("abort", id=request_id)
        return usage

    def set_cache_available(self, available: bool) -> None:
        super().set_cache_available(available)
        self._write("cache", available=available)

    def reset_prefix_cache(self) -> int:
        freed = super().reset_prefix_cache()
        self._write("flush")
        return freed
