"""A scheduler's decision record (scheduler_svc/recording.py), replayed into
a fresh core: every call in its order, with its clock reading, its step
seconds, its sampled tokens and its copy outcomes. The core must decide the
same things at every schedule() and finish the same requests at every
update(); the first difference ends the replay and is reported with the
line it happened on. Given a profile, it also sets each recorded step's
seconds beside the profile's prediction for the same work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstash.common.sampling import SamplingParams
from kvstash.errors import KvstashError
from kvstash.sim.profile import CostProfile
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.outputs import OffloadCommand, RestoreCommand, SchedulerOutput
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.recording import decisions, finished


@dataclass(slots=True)
class Replayed:
    calls: int = 0
    schedules: int = 0
    preemptions: int = 0
    copies: int = 0
    finishes: int = 0
    mismatch: str | None = None  # the first difference, with its line
    counters: dict[str, int] = field(default_factory=dict)
    # With a profile: each recorded step's seconds over what the profile
    # predicts for the same seqs (how well it times this run's steps).
    step_ratios: list[float] = field(default_factory=list)


def read_record(path: Path) -> list[dict[str, Any]]:
    lines = []
    with path.open(encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                if text.endswith("\n"):
                    raise ValueError(f"{path}:{n}: not JSON") from None
                break  # the process was killed mid-line: the record ends before it
    if not lines or lines[0].get("op") != "config":
        raise ValueError(f"{path}: not a decision record (its first line is no config)")
    return lines


def _config(raw: dict[str, Any]) -> SchedulerConfig:
    return SchedulerConfig(**{**raw, "eos_token_ids": tuple(raw["eos_token_ids"])})


def _sampling(raw: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{**raw, "stop_token_ids": tuple(raw["stop_token_ids"])})


class _Replay:
    def __init__(self, config: SchedulerConfig, profile: CostProfile | None) -> None:
        self.now = 0.0
        self.profile = profile
        self.core = Scheduler(config, clock=lambda: self.now)
        self.last: SchedulerOutput | None = None
        self.copies: dict[str, OffloadCommand | RestoreCommand] = {}
        self.result = Replayed()

    def output(self) -> SchedulerOutput:
        assert self.last is not None, "a step before any schedule()"
        return self.last

    def call(self, line: dict[str, Any]) -> str | None:
        """Applies one recorded call; what differs, if anything."""
        core, op = self.core, line["op"]
        if op == "add":
            core.add_request(line["id"], line["prompt"], _sampling(line["sampling"]))
        elif op == "schedule":
            self.last = out = core.schedule()
            self.result.schedules += 1
            self.result.preemptions += len(out.preempted)
            self.copies.update({c.snapshot_id: c for c in out.offloads})
            self.copies.update({c.snapshot_id: c for c in out.restores})
            got = decisions(out)
            if out.step_id != line["step"] or got != line["decided"]:
                return f"step {line['step']}: recorded {line['decided']}, replayed {got}"
        elif op == "step":
            out = self.output()
            core.observe_step(out, line["seconds"])
            if self.profile is not None:
                predicted = self.profile.step.seconds(out.seqs, out.num_decodes)
                self.result.step_ratios.append(line["seconds"] / predicted)
        elif op == "update":
            got_finished = finished(core.update(self.output(), line["sampled"]))
            self.result.finishes += len(got_finished)
            if got_finished != line["finished"]:
                return f"update: recorded finishes {line['finished']}, replayed {got_finished}"
        elif op in ("offloaded", "restored"):
            cmd = self.copies.pop(line["snapshot"])
            self.result.copies += 1
            if isinstance(cmd, OffloadCommand):
                core.finish_offload(cmd, line["bytes"], line["seconds"])
            else:
                core.finish_restore(cmd, line["bytes"], line["seconds"])
        elif op == "abort":
            core.abort(line["id"])
        elif op == "cache":
            core.set_cache_available(line["available"])
        elif op == "flush":
            core.reset_prefix_cache()
        else:
            raise ValueError(f"unknown call {op!r}")
        return None


def replay(lines: list[dict[str, Any]], profile: CostProfile | None = None) -> Replayed:
    run = _Replay(_config(lines[0]["config"]), profile)
    for n, line in enumerate(lines[1:], 2):
        run.now = line["t"]
        run.result.calls += 1
        try:
            mismatch = run.call(line)
        except (KvstashError, KeyError) as exc:  # a call the replayed core cannot take
            mismatch = f"{line['op']}: the replayed core refused it ({exc!r})"
        if mismatch is not None:
            run.result.mismatch = f"line {n}: {mismatch}"
            break
    else:
        run.core.check_integrity()
    stats = run.core.stats()
    run.result.counters = {"num_preemptions_offload": stats.num_preemptions_offload,
                           "num_preemptions_recompute": stats.num_preemptions_recompute,
                           "num_recomputed_tokens": stats.num_recomputed_tokens}
    return run.result
