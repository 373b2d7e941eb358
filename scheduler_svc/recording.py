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

and, in a P/D role, the edge's calls into its PdManager (`Scheduler.pd`):

    reserve    (decode) a reservation asked: id, prompt, sampling, and the answer
    remote     (decode) start_remote_decode: id, snapshot, tokens, first token
    handed_off (prefill) a hand-off copy's outcome, as offloaded
    remote_tokens / remote_finish   (prefill) what the decode instance sent
    take_back  (prefill) its decode instance was lost

Replayed in the same order with the same clock readings, a fresh core must
decide the same things: the record is every input the core has. Lines are
written as calls happen (line-buffered), so a killed process leaves a record
up to its last call. The file is 0600: it holds every prompt and output.
A write that fails (a full disk) ends the record there, logged; the
scheduler serves on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import os
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
from scheduler_svc.core.pd import PdManager
from scheduler_svc.core.request import Request, RequestUsage
from scheduler_svc.core.scheduler import Scheduler

log = logging.getLogger(__name__)


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
    } | ({"handoffs": [[c.request_id, c.snapshot_id, len(c.block_ids)] for c in out.handoffs]}
         if out.handoffs else {})


def finished(updates: Sequence[RequestUpdate]) -> list[list[str]]:
    return [[u.request_id, u.finish_status.value] for u in updates
            if u.finish_status is not None]


class RecordingScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, path: Path,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.prefix_segment_blocks:
            raise ValueError("recording decisions needs the prefix tier off "
                             "(--prefix-segment-tokens 0): replay does not model it yet")
        super().__init__(config, clock=clock)
        # Created 0600: the record holds every prompt and output.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._path = path
        self._file = open(fd, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - close()
        self._write("config", config=plain(dataclasses.asdict(config)))
        self._recording_pd = None if config.role is Role.MIXED else _RecordingPd(
            super().pd, self._write)

    @property
    def pd(self) -> PdManager:
        """The P/D manager the edge calls, its calls written down."""
        return self._recording_pd or super().pd  # type: ignore[return-value]

    def _write(self, op: str, **fields: Any) -> None:
        if self._file.closed:
            return
        try:
            self._file.write(json.dumps({"op": op, "t": self._clock(), **fields}) + "\n")
        except OSError as exc:  # raised out of the core's call, it would end the step loop
            log.error("--record-decisions %s: %s; the record ends here, serving on",
                      self._path, exc)
            with contextlib.suppress(OSError):  # flushing the failed line fails again
                self._file.close()

    def close(self) -> None:
        self._file.close()

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling: SamplingParams, *, handoff: bool = False,
                    stored_segments: int | None = 0,
                    block_hashes: Sequence[int] = ()) -> Request:
        req = super().add_request(request_id, prompt_token_ids, sampling, handoff=handoff)
        self._write("add", id=request_id, prompt=list(prompt_token_ids),
                    sampling=plain(dataclasses.asdict(sampling)), handoff=handoff)
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

    def reset_prefix_cache(self, kv_lost: bool = True) -> int:
        freed = super().reset_prefix_cache(kv_lost)
        self._write("flush", kv_lost=kv_lost)
        return freed


class _RecordingPd:
    """Forwards the edge's PdManager calls, writing each down (the core's own
    hooks call the manager itself, unrecorded: they follow from the rest)."""

    def __init__(self, pd: PdManager, write: Callable[..., None]) -> None:
        self._pd = pd
        self._write = write

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pd, name)  # what the edge only reads

    def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                sampling: SamplingParams) -> bool:
        accepted = self._pd.reserve(request_id, prompt_token_ids, sampling)
        self._write("reserve", id=request_id, prompt=list(prompt_token_ids),
                    sampling=plain(dataclasses.asdict(sampling)), accepted=accepted)
        return accepted

    def start_remote_decode(self, request_id: str, snapshot_id: str, num_tokens: int,
                            first_token_id: int) -> RestoreCommand:
        cmd = self._pd.start_remote_decode(request_id, snapshot_id, num_tokens, first_token_id)
        self._write("remote", id=request_id, snapshot=snapshot_id, tokens=num_tokens,
                    first=first_token_id)
        return cmd

    def finish_handoff(self, cmd: OffloadCommand, num_bytes: int | None,
                       seconds: float | None = None) -> bool:
        handed_off = self._pd.finish_handoff(cmd, num_bytes, seconds)
        self._write("handed_off", snapshot=cmd.snapshot_id, bytes=num_bytes, seconds=seconds,
                    handed_off=handed_off)
        return handed_off

    def remote_tokens(self, request_id: str, token_ids: Sequence[int]) -> RequestUpdate | None:
        update = self._pd.remote_tokens(request_id, token_ids)
        self._write("remote_tokens", id=request_id, tokens=list(token_ids))
        return update

    def finish_remote(self, request_id: str, token_ids: Sequence[int], stopped: bool,
                      remote: RequestUsage) -> RequestUpdate | None:
        update = self._pd.finish_remote(request_id, token_ids, stopped, remote)
        self._write("remote_finish", id=request_id, tokens=list(token_ids), stopped=stopped,
                    usage=plain(dataclasses.asdict(remote)),
                    status=None if update is None or update.finish_status is None
                    else update.finish_status.value)
        return update

    def take_back(self, request_id: str) -> None:
        self._pd.take_back(request_id)
        self._write("take_back", id=request_id)
