"""kvstash.common.units: the one definition of byte units, and the size and duration
parsers every CLI uses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstash.common import units

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), ("8GiB", 8 * units.GIB), ("512MiB", 512 * units.MIB), ("1.5G", 3 << 29),
    ("2k", 2 * units.KIB), (" 3 mb ", 3 * units.MIB), ("0", 0),
])
def test_parse_bytes(text: str, expected: int) -> None:
    assert units.parse_bytes(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("lots", "not a byte size: 'lots'"), ("", "not a byte size"),
    ("-1MiB", "must not be negative: '-1MiB'"),
])
def test_parse_bytes_names_bad_input(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        units.parse_bytes(text)


@pytest.mark.parametrize("text", ["inf", "nan", "-inf", "1e400", "infGiB"])
def test_parse_bytes_refuses_what_is_no_finite_size(text: str) -> None:
    """An infinity raised OverflowError, which argparse does not catch: a
    traceback for `--memory-budget inf`; a NaN's message named no input."""
    with pytest.raises(ValueError, match=f"not a finite byte size: {text!r}"):
        units.parse_bytes(text)


def test_a_service_refuses_an_infinite_byte_size_as_its_flag() -> None:
    done = subprocess.run([sys.executable, "-m", "cache_svc", "--memory-budget", "inf"],
                          check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "argument --memory-budget: not a finite byte size: 'inf'" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("text", "expected"), [
    ("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("1h", 3600.0), ("2d", 172800.0),
    ("0.5s", 0.5),
])
def test_parse_duration(text: str, expected: float) -> None:
    assert units.parse_duration(text) == expected


def test_parse_duration_names_bad_input() -> None:
    with pytest.raises(ValueError, match="not a duration: 'soon'"):
        units.parse_duration("soon")


def test_milliseconds_are_not_read_as_seconds() -> None:
    """"500ms" was 500 s: every trailing unit letter was stripped, the last read."""
    assert units.parse_duration("500ms") == pytest.approx(0.5)
    assert units.parse_duration("250 MS") == pytest.approx(0.25)
    for stacked in ("1hm", "5sm", "2dh"):
        with pytest.raises(ValueError, match=f"not a duration: {stacked!r}"):
            units.parse_duration(stacked)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "infs", "1e400"])
def test_parse_duration_refuses_what_is_no_finite_number_of_seconds(text: str) -> None:
    with pytest.raises(ValueError, match=f"not a finite duration: {text!r}"):
        units.parse_duration(text)


def test_units_import_neither_grpc_nor_torch() -> None:
    code = ("import sys, kvstash.common.units; "
            "sys.exit(sorted({'grpc', 'torch'} & sys.modules.keys()) or None)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_parse_counts() -> None:
    assert units.parse_counts("64,256,512") == (64, 256, 512)
    assert units.parse_counts("7") == (7,)
    for bad in ("", "64,,512", "0,4", "-1", "1.5", "a"):
        with pytest.raises(ValueError, match="comma-separated"):
            units.parse_counts(bad)
