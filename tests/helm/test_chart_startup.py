"""What helm/kvstash renders starts and stays evictable, beyond what the
services' parsers check (test_chart_flags.py): the scheduler waits for its
worker as long as the kubelet lets the worker load its model; prefix
segments hold whole KV blocks of the worker's size; the cache's memory
request fits its limit; disruption budgets leave a pod to evict. The values
refused instead: test_chart_values.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART,
    container,
    env,
    instances,
    of_kind,
    pools,
    render,
    render_error,
    workloads,
)

from gpu_worker.config import WorkerConfig

DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
PD = {"instances": {"role": "pd"}, "cache": {"mode": "shared"}}


def startup(period: int, failures: int) -> dict[str, Any]:
    return {"probes": {"startup": {"periodSeconds": period, "failureThreshold": failures,
                                   "timeoutSeconds": 5}}}


def scheduler_env(workload: dict[str, Any]) -> dict[str, str]:
    return env(container(workload["spec"]["template"]["spec"], "scheduler"))


def test_default_wait_is_the_workers_startup_budget(tmp_path: Path) -> None:
    """--worker-wait defaults to 120 s; the kubelet gives the worker 600."""
    probe = DEFAULTS["worker"]["probes"]["startup"]
    budget = probe["periodSeconds"] * probe["failureThreshold"]
    assert budget > 120
    wait = scheduler_env(instances(render({}, tmp_path)))["KVSTASH_SCHEDULER_WORKER_WAIT"]
    assert wait == str(budget)


@pytest.mark.parametrize("values", [{}, PD], ids=["mixed", "pd"])
def test_wait_follows_the_workers_startup_probe(values: dict[str, Any], tmp_path: Path) -> None:
    # 15 minutes to load, and the scheduler's own startup probe as long.
    docs = render({**values, "worker": startup(10, 90), "scheduler": startup(5, 180)}, tmp_path)
    schedulers = {role: scheduler_env(w) for role, w in pools(docs).items()}
    assert len(schedulers) == (2 if values else 1)
    for role, variables in schedulers.items():
        assert variables["KVSTASH_SCHEDULER_WORKER_WAIT"] == "900", role


def test_a_wait_of_ones_own_passes_as_given(tmp_path: Path) -> None:
    docs = render({"scheduler": {"flags": {"worker-wait": 450.5}}}, tmp_path)
    assert scheduler_env(instances(docs))["KVSTASH_SCHEDULER_WORKER_WAIT"] == "450.5"


def test_segments_of_the_workers_default_block_size(tmp_path: Path) -> None:
    """The chart's default block size is the worker's own."""
    block = WorkerConfig().block_size
    docs = render({"cache": {"prefixTier": {"segmentTokens": 3 * block}}}, tmp_path)
    assert scheduler_env(instances(docs))["KVSTASH_SCHEDULER_PREFIX_SEGMENT_TOKENS"] == str(
        3 * block)
    error = render_error({"cache": {"prefixTier": {"segmentTokens": 3 * block + 1}}}, tmp_path)
    assert f"not a multiple of the worker's KV block size {block} " in error


def test_segments_of_a_block_size_of_ones_own(tmp_path: Path) -> None:
    docs = render({"worker": {"flags": {"block-size": 32}},
                   "cache": {"prefixTier": {"segmentTokens": 96}}}, tmp_path)
    assert scheduler_env(instances(docs))["KVSTASH_SCHEDULER_PREFIX_SEGMENT_TOKENS"] == "96"


@pytest.mark.parametrize(("request_", "expected"), [
    ({}, "1568Mi"),
    ({"memory": ""}, "1568Mi"),  # rendered memory twice, "" and the limit
    ({"memory": "1Gi", "cpu": "2"}, "1Gi"),
    ({"memory": "1568Mi"}, "1568Mi"),
])
def test_cache_memory_request_within_its_limit(request_: dict[str, str], expected: str,
                                               tmp_path: Path) -> None:
    docs = render({"cache": {"resources": {"requests": request_}}}, tmp_path)
    resources = container(instances(docs)["spec"]["template"]["spec"], "cache")["resources"]
    assert resources["limits"]["memory"] == "1568Mi"  # 1Gi budget + 544Mi overhead
    assert resources["requests"] == {**DEFAULTS["cache"]["resources"]["requests"], **request_,
                                     "memory": expected}


def test_the_builtin_model_and_checkpoints_whatever_their_name(tmp_path: Path) -> None:
    # model.name names the built-in model only; a checkpoint is a directory.
    for values in ({"model": {"name": "tiny"}},
                   {"model": {"name": "llama-3.1-8b", "source": "pvc",
                              "pvc": {"claimName": "weights"}}}):
        worker = env(container(instances(render(values, tmp_path))["spec"]["template"]["spec"],
                               "worker"))
        assert worker["KVSTASH_WORKER_MODEL"] == (
            "tiny" if values["model"]["name"] == "tiny" else "/models")


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
