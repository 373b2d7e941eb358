"""`python -m cache_svc` flags: every default is CacheConfig's, and sizes and
durations are read with their units."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from cache_svc.__main__ import build_parser, config_from_args
from cache_svc.config import CacheConfig
from cache_svc.disk import MIN_FILE_BYTES
from cache_svc.model import pages
from kvstash.common.units import GIB, MIB

SMALLEST_FILE = pages(MIN_FILE_BYTES)  # 8 KiB with 4 KiB pages


def test_no_flags_give_the_config_defaults() -> None:
    assert config_from_args(build_parser().parse_args([])) == CacheConfig()


def test_flags_with_units_reach_the_config(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "--memory-budget", "8GiB", "--disk-dir", str(tmp_path), "--disk-budget", "100GiB",
        "--default-ttl", "2h", "--reserve-wait", "30s", "--max-inflight", "64MiB",
        "--buffer-pool-idle", "5m",
    ])
    config = config_from_args(args)
    assert (config.memory_budget_bytes, config.disk_budget_bytes) == (8 * GIB, 100 * GIB)
    assert (config.default_ttl_s, config.reserve_wait_s) == (7200, 30.0)
    assert (config.max_inflight_bytes, config.buffer_pool_idle_s) == (64 * MIB, 300.0)


@pytest.mark.parametrize(("flags", "message"), [
    (["--memory-budget", "lots"], "not a byte size: 'lots'"),
    (["--default-ttl", "soon"], "not a duration: 'soon'"),
    # Was taken as 1 s: every snapshot expired at the next sweep.
    (["--default-ttl", "-5"], "not a duration > 0: '-5'"),
    (["--default-ttl", "0"], "not a duration > 0: '0'"),
    (["--sweep-interval", "nan"], "not a finite duration: 'nan'"),  # or the sweeper spins
    (["--reserve-wait", "inf"], "not a finite duration: 'inf'"),
    (["--log-level", "verbose"], "invalid choice: 'verbose'"),  # not a traceback at start
])
def test_bad_values_name_the_flag_and_value(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(flags)
    err = capsys.readouterr().err
    assert flags[0] in err and message in err


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("field", ["reserve_wait_s", "sweep_interval_s", "shared_lease_s",
                                   "put_idle_s", "get_idle_s", "buffer_pool_idle_s"])
def test_durations_must_be_finite(field: str, value: float) -> None:
    """NaN passes any comparison check: a NaN sweep interval made the sweeper
    spin, a NaN reserve_wait_s a put that never times out."""
    with pytest.raises(ValueError, match=f"{field} is {value}, must be .* and finite"):
        CacheConfig(**{field: value})


def test_a_default_ttl_no_header_can_carry_is_refused() -> None:
    """SnapshotHeader.ttl_s is a uint32: beyond it, every put that took the
    default committed and then answered INTERNAL, as did each stat and get."""
    args = build_parser().parse_args(["--default-ttl", "50000d"])
    with pytest.raises(ValueError, match=re.escape(
            "default_ttl_s is 4320000000, must be in [1, 4294967295]")):
        config_from_args(args)
    assert CacheConfig(default_ttl_s=2**32 - 1).default_ttl_s == 2**32 - 1


def test_a_disk_dir_without_a_budget_is_refused(tmp_path: Path) -> None:
    """Not a disk tier of 0 bytes, which would also evict, at start, every
    snapshot a previous run left there."""
    args = build_parser().parse_args(["--disk-dir", str(tmp_path)])
    with pytest.raises(ValueError, match=re.escape(
            f"disk_dir is {tmp_path} but disk_budget_bytes is 0, less than the smallest "
            f"snapshot file ({SMALLEST_FILE} bytes): give the disk tier a budget "
            "(--disk-budget), or no disk_dir for none")):
        config_from_args(args)


def test_a_disk_budget_that_holds_no_snapshot_is_refused(tmp_path: Path) -> None:
    """Any budget below the smallest file is a tier of 0 bytes too."""
    with pytest.raises(ValueError, match=f"disk_budget_bytes is {SMALLEST_FILE - 1}, less"):
        CacheConfig(disk_dir=tmp_path, disk_budget_bytes=SMALLEST_FILE - 1)
    CacheConfig(disk_dir=tmp_path, disk_budget_bytes=SMALLEST_FILE)
