"""What helm/kvstash renders starts and stays evictable, beyond what the
services' parsers check (test_chart_flags.py). The values refused instead:
test_chart_values.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chart_helpers import of_kind, render, workloads


@pytest.mark.parametrize(("values", "budget"), [
    ({"instances": {"replicas": 2, "pdb": {"minAvailable": 1, "maxUnavailable": None}}},
     {"minAvailable": 1}),
    ({"instances": {"replicas": 0, "pdb": {"minAvailable": 0, "maxUnavailable": None}}},
     {"minAvailable": 0}),
    ({}, {"maxUnavailable": 1}),
])
def test_budgets_that_leave_a_pod_to_evict_render(values: dict[str, Any], budget: dict[str, int],
                                                  tmp_path: Path) -> None:
    docs = render(values, tmp_path)
    (pdb,) = of_kind(docs, "PodDisruptionBudget")
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == budget
    assert workloads(docs, "instance")
