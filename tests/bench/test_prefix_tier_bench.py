"""bench.prefix_tier_bench's verdict on its trace part (the stacks stood in
for: this checks what it makes of their records)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import prefix_tier_bench as bench
from kvstash.workload.metrics import RequestRecord


@pytest.mark.parametrize("error", [None, "HTTP_500"])
def test_the_trace_part_fails_where_a_request_failed(
        error: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A request failed alike in every setting left the outputs equal, and
    the bench passed, its TTFTs taken over the requests that completed."""
    def records() -> list[RequestRecord]:
        second = (RequestRecord(1, 0.1, [], 0, [], None, error) if error
                  else RequestRecord(1, 0.1, [0.7, 0.8], 2, [67, 68], 0.8))
        return [RequestRecord(0, 0.0, [0.5, 0.6], 2, [65, 66], 0.6), second]

    trace = SimpleNamespace(requests=[object(), object()], rate=1.0)
    counters = dict.fromkeys(bench.COUNTERS, 0)
    for name, value in {"commit": lambda: "test", "read_trace": lambda *a, **k: None,
                        "conversations": lambda *a, **k: None,
                        "fit": lambda *a, **k: (trace, 0),
                        "build_prompts": lambda *a, **k: None,
                        "run_settings": lambda *a, **k: {
                            s: (records(), dict(counters)) for s in bench.SETTINGS}}.items():
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench.plots, "latency_cdfs", lambda *a, **k: None)
    code = bench.main(["--parts", "trace", "--model", "tiny", "--out", str(tmp_path)])
    assert code == (1 if error else 0)
