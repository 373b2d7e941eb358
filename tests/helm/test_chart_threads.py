"""The worker's torch threads come from its CPU limit, not the node's cores:
torch inside a container sees every core of the node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chart_helpers import container, env, pools, render, render_error, rendered

VARIABLE = "KVSTASH_WORKER_NUM_THREADS"


def worker_env(values: dict[str, Any], tmp_path: Path) -> dict[str, str]:
    docs = render(values, tmp_path)
    (pool,) = pools(docs).values()
    return env(container(pool["spec"]["template"]["spec"], "worker"))


def resources(**cpu: str | float) -> dict[str, Any]:
    """worker.resources with these CPU quantities (requests=..., limits=...)."""
    return {"worker": {"resources": {kind: {"cpu": q, "memory": "2Gi"}
                                     for kind, q in cpu.items()}}}


@pytest.mark.parametrize(("values", "threads"), [
    ({}, "1"),  # values.yaml: a request of 1 CPU, no CPU limit
    (resources(requests="1", limits="2500m"), "3"),  # the limit binds, rounded up
    (resources(requests="500m"), "1"),
    (resources(limits=1.5), "2"),
    (resources(requests="2", limits=4), "4"),
    ({"worker": {"numThreads": 6, **resources(limits="2")["worker"]}}, "6"),
    ({"worker": {"flags": {"num-threads": 5}}}, "5"),  # a flag of its own wins too
])
def test_threads_follow_the_cpu_limit(values: dict[str, Any], threads: str,
                                      tmp_path: Path) -> None:
    assert worker_env(values, tmp_path)[VARIABLE] == threads


def test_no_cpu_quantity_leaves_it_to_the_worker(tmp_path: Path) -> None:
    """Without a limit or request the worker reads its own cgroup (null
    deletes values.yaml's request)."""
    values = {"worker": {"resources": {"requests": {"cpu": None}}}}
    assert VARIABLE not in worker_env(values, tmp_path)


def test_each_pd_pool_from_its_own_worker_resources() -> None:
    """pd-gpu: decode workers request 4 CPUs, prefill ones the shared 1."""
    found = {role: env(container(d["spec"]["template"]["spec"], "worker"))[VARIABLE]
             for role, d in pools(rendered("pd-gpu")).items()}
    assert found == {"prefill": "1", "decode": "4"}


@pytest.mark.parametrize(("values", "message"), [
    (resources(limits="two"), 'CPU "two" is not a quantity like 2, 1.5 or 500m'),
    ({"worker": {"numThreads": 0}}, "worker.numThreads: Must be greater than or equal to 1"),
])
def test_bad_values_are_refused(values: dict[str, Any], message: str, tmp_path: Path) -> None:
    assert message in render_error(values, tmp_path)
