"""`make bench` (python -m bench) runs every benchmark whatever one does."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import NoReturn

import pytest

from bench import __main__ as bench_main


def test_a_benchmark_that_raises_or_exits_fails_the_run_and_the_rest_still_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []

    def raises() -> NoReturn:
        ran.append("raises")
        raise RuntimeError("broken")

    def exits() -> NoReturn:
        ran.append("exits")
        raise SystemExit("the cache's arena cannot be mapped here")

    def fine() -> int:
        ran.append("fine")
        return 0

    for name, main in {"b_raises": raises, "b_exits": exits, "b_fine": fine}.items():
        monkeypatch.setitem(sys.modules, name, SimpleNamespace(main=main))
    monkeypatch.setattr(bench_main, "BENCHMARKS", ("b_raises", "b_exits", "b_fine"))
    assert bench_main.main() == 1
    assert ran == ["raises", "exits", "fine"]
    assert "failed: b_raises, b_exits" in capsys.readouterr().err
