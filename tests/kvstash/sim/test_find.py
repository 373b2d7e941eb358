"""--find's search: doubling, halving, bisection, and giving up."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvstash.common.units import MIB
from kvstash.sim.find import close_enough, search
from kvstash.workload.metrics import RequestRecord, Slo, Summary, summarize

TEMPLATE = summarize([RequestRecord(0, 0.0, [0.1], 1, [], 0.1)], Slo(1.0, 1.0))


def stepping_at(threshold: int, low: float = 0.5, flat: bool = False
                ) -> tuple[list[int], Callable[[int], Summary]]:
    """Attainment `low` below `threshold`, 1 from it; the other figures change
    with the value unless `flat` (the run does not depend on it at all)."""
    calls: list[int] = []

    def run(value: int) -> Summary:
        calls.append(value)
        return dataclasses.replace(TEMPLATE, attainment=1.0 if value >= threshold else low,
                                   goodput=0.0 if flat else value / 1e3)
    return calls, run


def test_doubles_then_bisects_to_the_least_value() -> None:
    calls, run = stepping_at(37)
    found = search(1, 4096, 0.9, run, close_enough("instances"))
    assert found.value == 37
    assert calls[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert len(calls) == len(set(calls))  # nothing simulated twice


def test_halves_from_a_start_that_already_meets() -> None:
    calls, run = stepping_at(37)
    found = search(300, 4096, 0.9, run, close_enough("instances"))
    assert found.value == 37 and calls[:3] == [300, 150, 75]


def test_gives_up_beyond_the_largest_or_when_nothing_changes() -> None:
    _, never = stepping_at(10**9, low=0.2)
    capped = search(1, 64, 0.9, never, close_enough("instances"))
    assert capped.value is None and max(capped.tried) == 64
    rising: list[int] = []

    def rises(value: int) -> Summary:
        rising.append(value)
        return dataclasses.replace(TEMPLATE, attainment=min(0.8, value / 100),
                                   goodput=value / 1e3)
    assert search(1, 4096, 0.9, rises, close_enough("instances")).value is None
    assert max(rising) == 4096  # still changing up to the cap: searched on
    _, flat = stepping_at(10**9, low=0.4, flat=True)
    stopped = search(1, 1 << 30, 0.9, flat, close_enough("instances"))
    assert stopped.value is None and max(stopped.tried) == 4  # 1, 2, 4: all the same


def test_bytes_bisect_to_within_five_percent() -> None:
    _, run = stepping_at(700 * MIB)
    found = search(64 * MIB, 1 << 40, 0.9, run, close_enough("cache-memory-budget"))
    assert found.value is not None and 700 * MIB <= found.value <= 700 * MIB * 1.06
