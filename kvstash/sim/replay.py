"""A scheduler's decision record (scheduler_svc/recording.py), replayed into
a fresh core: every call in its order, with its clock reading, its step
seconds, its sampled tokens and its copy outcomes. The core must decide the
same things at every schedule() and finish the same requests at every
update(); the first difference ends the replay and is reported with the
line it happened on. A P/D instance's record also holds the edge's calls
into its PdManager (reservations asked and answered, remote decodes,
hand-off outcomes, tokens from the decode instance, take-backs): replayed
in place, with the answers compared. Given a profile, it also sets each
recorded step's seconds beside the profile's prediction for the same work.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvstash.common.sampling import SamplingParams
from kvstash.errors import KvstashError
from kvstash.sim.profile import CostProfile
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.costs import step_features
from scheduler_svc.core.outputs import OffloadCommand, RestoreCommand, SchedulerOutput
from scheduler_svc.core.request import RequestUsage
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
    # Each recorded step's features (costs.step_features) and seconds.
    steps: list[tuple[tuple[float, ...], float]] = field(default_factory=list)
    # Each step's turn of the engine's loop: from its schedule() to the next
    # (the step, the update, the streams and copies let run, the next
    # schedule); none for a step the record ends after.
    turns: list[float] = field(default_factory=list)


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
    if not lines or not isinstance(lines[0], dict) or lines[0].get("op") != "config":
        raise ValueError(f"{path}: not a decision record (its first line is no config)")
    for n, line in enumerate(lines[1:], 2):
        if not isinstance(line, dict) or "op" not in line or "t" not in line:
            raise ValueError(f"{path}:{n}: not a decision (an object with op and t)")
    try:
        _config(lines[0]["config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}:1: not a scheduler config ({exc!r})") from None
    return lines


def _config(raw: dict[str, Any]) -> SchedulerConfig:
    """The recorded config, its enums made from their values here (the core
    compiled by mypyc, `--core compiled`, takes no strings for them)."""
    values = {**raw, "eos_token_ids": tuple(raw["eos_token_ids"])}
    for spec in fields(SchedulerConfig):
        if isinstance(spec.default, enum.Enum) and spec.name in values:
            values[spec.name] = type(spec.default)(values[spec.name])
    return SchedulerConfig(**values)


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
        self.stepped_at: float | None = None  # the latest step's schedule() time

    def output(self) -> SchedulerOutput:
        if self.last is None:
            raise ValueError("a step before any schedule()")
        return self.last

    def call(self, line: dict[str, Any]) -> str | None:
        """Applies one recorded call; what differs, if anything."""
        core, op = self.core, line["op"]
        if op in _PD_CALLS:
            return self.pd_call(line)
        if op == "add":
            core.add_request(line["id"], line["prompt"], _sampling(line["sampling"]),
                             handoff=line.get("handoff", False))
        elif op == "schedule":
            if self.stepped_at is not None:
                self.result.turns.append(line["t"] - self.stepped_at)
            self.last = out = core.schedule()
            self.stepped_at = line["t"] if out.seqs else None
            self.result.schedules += 1
            self.result.preemptions += len(out.preempted)
            for cmds in (out.offloads, out.restores, out.handoffs):
                self.copies.update({c.snapshot_id: c for c in cmds})
            got = decisions(out)
            if out.step_id != line["step"] or got != line["decided"]:
                return f"step {line['step']}: recorded {line['decided']}, replayed {got}"
        elif op == "step":
            out = self.output()
            core.observe_step(out, line["seconds"])
            self.result.steps.append((step_features(out.seqs, out.num_decodes),
                                      line["seconds"]))
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
            core.reset_prefix_cache(line["kv_lost"])
        else:
            raise ValueError(f"unknown call {op!r}")
        return None

    def pd_call(self, line: dict[str, Any]) -> str | None:
        """A call the edge made into the P/D manager; what differs, if anything."""
        pd, op = self.core.pd, line["op"]
        if op == "reserve":
            accepted = pd.reserve(line["id"], line["prompt"], _sampling(line["sampling"]))
            if accepted != line["accepted"]:
                return f"reserve {line['id']}: recorded {line['accepted']}, replayed {accepted}"
        elif op == "remote":
            cmd = pd.start_remote_decode(line["id"], line["snapshot"], line["tokens"],
                                         line["first"])
            self.copies[cmd.snapshot_id] = cmd
        elif op == "handed_off":
            handoff = self.copies.pop(line["snapshot"])
            if not isinstance(handoff, OffloadCommand):
                raise ValueError(f"snapshot {line['snapshot']} is no hand-off")
            self.result.copies += 1
            handed_off = pd.finish_handoff(handoff, line["bytes"], line["seconds"])
            if handed_off != line["handed_off"]:
                return (f"hand-off {line['snapshot']}: recorded {line['handed_off']}, "
                        f"replayed {handed_off}")
        elif op == "remote_tokens":
            pd.remote_tokens(line["id"], line["tokens"])
        elif op == "remote_finish":
            update = pd.finish_remote(line["id"], line["tokens"], line["stopped"],
                                      RequestUsage(**line["usage"]))
            status = None if update is None or update.finish_status is None else (
                update.finish_status.value)
            if status != line["status"]:
                return f"remote finish {line['id']}: recorded {line['status']}, replayed {status}"
        else:  # take_back
            pd.take_back(line["id"])
        return None


_PD_CALLS = frozenset({"reserve", "remote", "handed_off", "remote_tokens", "remote_finish",
                       "take_back"})


def replay(lines: list[dict[str, Any]], profile: CostProfile | None = None) -> Replayed:
    run = _Replay(_config(lines[0]["config"]), profile)
    for n, line in enumerate(lines[1:], 2):
        run.now = line["t"]
        run.result.calls += 1
        try:
            mismatch = run.call(line)
        except (KvstashError, KeyError, TypeError, ValueError) as exc:  # a call the replayed
            # core cannot take: a field missing, of another type, out of order (was a traceback)
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
