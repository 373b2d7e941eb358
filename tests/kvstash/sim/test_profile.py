"""Cost profiles: the shipped ones parse; a bad file names its bad field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvstash.common.sampling import SamplingParams
from kvstash.sim.profile import PROFILES, ProfileError, parse_profile, read_profile
from scheduler_svc.core.costs import step_features
from scheduler_svc.core.seq import ScheduledSeq

GOOD: dict[str, Any] = {
    "name": "test", "bytes_per_block": 1024, "block_size": 16,
    "step": {"fixed_s": 0.01, "decode_row_s": 1e-3, "decode_position_s": 1e-6,
             "prefill_token_s": 1e-4, "prefill_square_s": 1e-7},
    "copy": {path: {"fixed_s": 0.001, "bytes_per_s": 1e9} for path in ("arena", "grpc", "disk")},
    "source": {"step": "a test"},
}


def test_shipped_profiles_parse_and_say_where_each_number_came_from() -> None:
    shipped = sorted(PROFILES.glob("*.json"))
    assert shipped
    for path in shipped:
        profile = read_profile(path)
        assert {"step", "copy.arena", "copy.grpc", "copy.disk"} <= set(profile.source)
        assert profile.step.seconds([], 0) == profile.step.fixed_s > 0


def test_a_step_is_timed_by_the_cores_own_step_line() -> None:
    s = SamplingParams(1)
    decode = ScheduledSeq("d", [1], 9, [0], True, s)  # position 9
    chunk = ScheduledSeq("p", [1, 2, 3], 4, [1], True, s)  # positions 4..6: 7^2 - 4^2 = 33
    assert step_features([decode, chunk], 1) == (1.0, 1, 9, 3, 33)
    profile = parse_profile(GOOD)
    assert profile.step.seconds([decode, chunk], 1) == pytest.approx(
        0.01 + 1e-3 + 9e-6 + 3e-4 + 33e-7)
    assert profile.copy["grpc"].seconds(10**9) == pytest.approx(1.001)


def edited(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    raw = copy.deepcopy(GOOD)
    *parents, last = path
    node = raw
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return raw


@pytest.mark.parametrize(("path", "value", "message"), [
    (("step", "prefill_square_s"), KeyError,
     r"profile.step: missing field\(s\) prefill_square_s"),
    (("step", "warp_s"), 1.0, r"profile.step: unknown field\(s\) warp_s"),
    (("step", "fixed_s"), -1, r"profile.step.fixed_s: must be >= 0, got -1"),
    (("step", "fixed_s"), "fast", r"profile.step.fixed_s: a finite number is needed"),
    (("step", "fixed_s"), float("nan"), r"profile.step.fixed_s: a finite number is needed"),
    (("copy", "grpc", "bytes_per_s"), 0, r"profile.copy.grpc.bytes_per_s: must be > 0"),
    (("copy", "disk"), KeyError, r"profile.copy: missing field\(s\) disk"),
    (("block_size",), 0, r"profile.block_size: a positive integer is needed"),
    (("source",), {"step": 3}, r"profile.source: an object of strings"),
    (("name",), "", r"profile.name: a non-empty string"),
])
def test_a_bad_field_is_named(path: tuple[str, ...], value: Any, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        parse_profile(edited(path, value))


def test_unreadable_files_say_why(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        read_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        read_profile(bad)
    bad.write_text(json.dumps([1]))
    with pytest.raises(ProfileError, match="an object is needed"):
        read_profile(bad)
