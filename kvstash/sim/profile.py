"""A cost profile: how long a simulated worker's step and a simulated copy take.

    step_s = fixed_s + decode_row_s * decode rows + decode_position_s * their positions
             + prefill_token_s * prefill tokens + prefill_square_s * sum((s+n)^2 - s^2)
             over its prefill chunks [s, s+n): the line the scheduler's own cost
             model fits (scheduler_svc/core/costs.py, step_features); a decode's
             position costs far more than a prefill's on the CPU path
    copy_s = fixed_s + bytes / bytes_per_s        per path: arena, grpc, disk

A profile is a small JSON file; every number sits beside where it came from
(`source`: a calibration run's command, machine and date, or an estimate's
reference). `read_profile` refuses a file with a missing, unknown or
out-of-range field, naming it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from scheduler_svc.core.costs import step_features
from scheduler_svc.core.seq import ScheduledSeq
from scheduler_svc.core.step_fit import nnls, normal_equations

COPY_PATHS = ("arena", "grpc", "disk")
PROFILES = Path(__file__).parent / "profiles"  # the shipped ones
DEFAULT_PROFILE = PROFILES / "cpu-llama-small-float32.json"


class ProfileError(ValueError):
    """A profile file that cannot be used, with the field at fault."""


@dataclass(frozen=True, slots=True)
class StepCost:
    """Coefficients of step_features, in its order."""

    fixed_s: float
    decode_row_s: float
    decode_position_s: float
    prefill_token_s: float
    prefill_square_s: float

    def seconds(self, seqs: Sequence[ScheduledSeq], num_decodes: int) -> float:
        """One step over `seqs`, of which the first `num_decodes` are decodes."""
        return self.of_features(step_features(seqs, num_decodes))

    def of_features(self, features: Sequence[float]) -> float:
        """One step of these step_features."""
        return (self.fixed_s * features[0] + self.decode_row_s * features[1]
                + self.decode_position_s * features[2] + self.prefill_token_s * features[3]
                + self.prefill_square_s * features[4])


@dataclass(frozen=True, slots=True)
class CopyCost:
    fixed_s: float
    bytes_per_s: float

    def seconds(self, num_bytes: int) -> float:
        return self.fixed_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True, slots=True)
class CostProfile:
    name: str  # e.g. "llama-small float32, 2-core CPU"
    bytes_per_block: int  # KV bytes of one block, all layers
    block_size: int  # tokens per block the profile was measured with
    step: StepCost
    copy: Mapping[str, CopyCost]  # by path: COPY_PATHS
    source: Mapping[str, str]  # where each number came from

    def block_bytes(self, block_size: int) -> int:
        """KV bytes of one block of `block_size` tokens (the run's, maybe not the profile's)."""
        return self.bytes_per_block * block_size // self.block_size

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bytes_per_block": self.bytes_per_block,
                "block_size": self.block_size, "step": _as_dict(self.step),
                "copy": {path: _as_dict(cost) for path, cost in self.copy.items()},
                "source": dict(self.source)}


def _as_dict(obj: StepCost | CopyCost) -> dict[str, float]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _number(raw: Mapping[str, Any], key: str, where: str, *, positive: bool = False) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where}.{key}: a finite number is needed, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ProfileError(f"{where}.{key}: must be {'> 0' if positive else '>= 0'}, "
                           f"got {value}")
    return float(value)


def _object(raw: Any, where: str, keys: Iterable[str]) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: an object is needed, got {type(raw).__name__}")
    wanted = set(keys)
    if unknown := sorted(set(raw) - wanted):
        raise ProfileError(f"{where}: unknown field(s) {', '.join(unknown)}")
    if missing := sorted(wanted - set(raw)):
        raise ProfileError(f"{where}: missing field(s) {', '.join(missing)}")
    return raw


def parse_profile(raw: Any, where: str = "profile") -> CostProfile:
    top = _object(raw, where, ("name", "bytes_per_block", "block_size", "step", "copy",
                               "source"))
    step_raw = _object(top["step"], f"{where}.step", (f.name for f in fields(StepCost)))
    step = StepCost(**{f.name: _number(step_raw, f.name, f"{where}.step")
                       for f in fields(StepCost)})
    copy_raw = _object(top["copy"], f"{where}.copy", COPY_PATHS)
    copy = {}
    for path in COPY_PATHS:
        entry = _object(copy_raw[path], f"{where}.copy.{path}", ("fixed_s", "bytes_per_s"))
        copy[path] = CopyCost(_number(entry, "fixed_s", f"{where}.copy.{path}"),
                              _number(entry, "bytes_per_s", f"{where}.copy.{path}",
                                      positive=True))
    for key in ("bytes_per_block", "block_size"):
        if isinstance(top[key], bool) or not isinstance(top[key], int) or top[key] < 1:
            raise ProfileError(f"{where}.{key}: a positive integer is needed, got {top[key]!r}")
    source = top["source"]
    if not isinstance(source, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in source.items()):
        raise ProfileError(f"{where}.source: an object of strings is needed")
    if not isinstance(top["name"], str) or not top["name"]:
        raise ProfileError(f"{where}.name: a non-empty string is needed")
    return CostProfile(top["name"], top["bytes_per_block"], top["block_size"], step, copy,
                       source)


def read_profile(path: Path) -> CostProfile:
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not JSON: {exc}") from None
    return parse_profile(raw, str(path))


def lstsq(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> tuple[list[float], float]:
    """Least squares of the relative error (a 10 ms step matters as much as a
    300 ms one), every coefficient >= 0, by the scheduler's own solver
    (scheduler_svc.core.step_fit.nnls); and the fit's RMS relative error."""
    scaled = [[x / y for x in row] for row, y in zip(rows, targets, strict=True)]
    full = nnls(*normal_equations(scaled, [1.0] * len(scaled)))
    errors = [sum(c * x for c, x in zip(full, row, strict=True)) / y - 1
              for row, y in zip(rows, targets, strict=True)]
    return full, math.sqrt(sum(e * e for e in errors) / len(errors))
