"""Byte and time units, and the parsers for sizes, durations and counts given as text.

Imports neither grpc nor torch, so configs, CLIs and wire codecs can all use it.
"""

from __future__ import annotations

import math

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

_BYTES_PER_UNIT = {"": 1, "b": 1, "k": KIB, "m": MIB, "g": GIB, "t": 1 << 40}
# "ms" first: "500ms" is half a second, not 500 s ("m" and "s" are suffixes of it).
_SECONDS_PER_UNIT = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_bytes(text: str) -> int:
    """"8GiB", "512MiB", "1.5G", "4096" -> bytes. Raises ValueError naming the input."""
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    num, unit = (s[:-1], s[-1]) if s and s[-1] in "kmgt" else (s, "")
    try:
        value = float(num) * _BYTES_PER_UNIT[unit]
    except ValueError:
        raise ValueError(f"not a byte size: {text!r} (try 512MiB, 8GiB)") from None
    if not math.isfinite(value):  # "inf", "nan", "1e400": int() would raise its own error
        raise ValueError(f"not a finite byte size: {text!r} (try 512MiB, 8GiB)")
    if value < 0:
        raise ValueError(f"byte size must not be negative: {text!r}")
    return int(value)


def parse_duration(text: str) -> float:
    """"90", "90s", "500ms", "30m", "1h", "1d" -> seconds. Raises ValueError
    naming the input, also for nan and inf: a NaN passes checks such as
    `seconds <= 0`; and for more than one unit ("1hm")."""
    s = text.strip().lower()
    unit = next((u for u in _SECONDS_PER_UNIT if s.endswith(u)), "")
    try:
        seconds = float(s.removesuffix(unit)) * _SECONDS_PER_UNIT.get(unit, 1)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (try 90s, 30m, 1h)") from None
    if not math.isfinite(seconds):
        raise ValueError(f"not a finite duration: {text!r} (try 90s, 30m, 1h)")
    return seconds


def parse_counts(text: str) -> tuple[int, ...]:
    """"64,256,512" -> (64, 256, 512), each >= 1. Raises ValueError naming the input."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise ValueError(f"not counts >= 1, comma-separated: {text!r} (try 64,256,512)")
    return counts
