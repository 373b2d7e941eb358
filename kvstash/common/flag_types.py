"""argparse types every command line shares: a bad value is refused at
parse time with its flag named ("argument --memory-budget: ..."), before
anything starts.

    duration        "90", "90s", "500ms", "30m", "1h" -> seconds, finite
    positive_duration  the same, > 0
    byte_size       "8GiB", "512MiB", "4096" -> bytes
    byte_size_text  the same checked, kept as written (passed on to a service)
    port            0-65535
    positive_int    a whole number > 0
    non_negative_int  a whole number >= 0
    host_port       "host:port", the port 0-65535
    target          an address to call: any gRPC target, any port 0-65535
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from kvstash.common import units
from kvstash.common.binding import MAX_PORT, check_target, split_address

T = TypeVar("T")


def _refusing(parse: Callable[[str], T], text: str) -> T:
    """`parse(text)`, its ValueError as argparse's."""
    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def duration(text: str) -> float:
    return _refusing(units.parse_duration, text)


def positive_duration(text: str) -> float:
    seconds = duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"not a duration > 0: {text!r}")
    return seconds


def byte_size(text: str) -> int:
    return _refusing(units.parse_bytes, text)


def byte_size_text(text: str) -> str:
    byte_size(text)
    return text


def port(text: str) -> int:
    if not text.isdigit() or int(text) > MAX_PORT:
        raise argparse.ArgumentTypeError(f"not a port (0-{MAX_PORT}): {text!r}")
    return int(text)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a whole number > 0: {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"not a whole number >= 0: {text!r}")
    return value


def host_port(text: str) -> str:
    host, _ = _refusing(split_address, text)
    if not host:
        raise argparse.ArgumentTypeError(f"address {text!r} is not host:port")
    return text


def target(text: str) -> str:
    _refusing(check_target, text)
    return text
