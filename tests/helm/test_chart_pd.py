"""helm/kvstash with instances.role pd: a prefill and a decode pool, each its
own workload, headless Service and disruption budget, placed and sized on its
own; prefill schedulers pointed at the decode pool's headless Service and,
with auth on, given the token decode schedulers demand; the public Service on
the prefill pool. (The shared cache both pools use: test_chart_shared.py;
values refused: test_chart_values.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART,
    PD_VALUE_SETS,
    VALUE_SETS,
    container,
    env,
    mounts,
    of_kind,
    one,
    pod_labels,
    pools,
    rendered,
    selects,
    volumes,
    workloads,
)

DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
ROLES = ("prefill", "decode")
PD_VARIABLES = ("KVSTASH_SCHEDULER_ROLE", "KVSTASH_SCHEDULER_DECODE_ADDRESS",
                "KVSTASH_SCHEDULER_HANDOFF_WAIT", "KVSTASH_SCHEDULER_RESERVATION_TIMEOUT")


def pool_value(value_set: str, role: str, key: str) -> Any:
    """instances.<role>.<key> as the value set, else values.yaml, has it."""
    own = VALUE_SETS[value_set]["instances"].get(role, {})
    return own.get(key, DEFAULTS["instances"][role][key])


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"])


def services(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}


@pytest.mark.parametrize("value_set", PD_VALUE_SETS)
def test_each_pool_is_its_own_workload(value_set: str) -> None:
    docs = rendered(value_set)
    by_role = pools(docs)
    assert set(by_role) == set(ROLES)
    for role, other in (ROLES, ROLES[::-1]):
        workload = by_role[role]
        assert workload["metadata"]["name"] == f"rel-kvstash-{role}"
        assert workload["spec"]["replicas"] == pool_value(value_set, role, "replicas")
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selects(selector, pod_labels(workload))
        assert not selects(selector, pod_labels(by_role[other])), "selectors overlap"
        names = [c["name"] for c in pod_spec(workload)["containers"]]
        assert names == ["scheduler", "worker"]  # the cache is the release's one
        assert workload["kind"] == "Deployment"


@pytest.mark.parametrize("value_set", PD_VALUE_SETS)
def test_schedulers_get_their_pools_flags(value_set: str) -> None:
    docs = rendered(value_set)
    by_role = pools(docs)
    prefill, decode = (env(container(pod_spec(by_role[r]), "scheduler")) for r in ROLES)
    assert prefill["KVSTASH_SCHEDULER_ROLE"] == "prefill"
    assert decode["KVSTASH_SCHEDULER_ROLE"] == "decode"
    assert prefill["KVSTASH_SCHEDULER_HANDOFF_WAIT"] == str(
        pool_value(value_set, "prefill", "handoffWait"))
    assert decode["KVSTASH_SCHEDULER_RESERVATION_TIMEOUT"] == str(
        pool_value(value_set, "decode", "reservationTimeout"))
    # Each P/D flag on its own role only.
    assert "KVSTASH_SCHEDULER_RESERVATION_TIMEOUT" not in prefill
    for name in ("KVSTASH_SCHEDULER_DECODE_ADDRESS", "KVSTASH_SCHEDULER_HANDOFF_WAIT"):
        assert name not in decode


@pytest.mark.parametrize("value_set", PD_VALUE_SETS)
def test_decode_address_is_the_decode_pools_headless_service(value_set: str) -> None:
    docs = rendered(value_set)
    by_role = pools(docs)
    address = env(container(pod_spec(by_role["prefill"]), "scheduler"))[
        "KVSTASH_SCHEDULER_DECODE_ADDRESS"]
    host, port = address.rsplit(":", 1)
    name, namespace, svc, domain = host.split(".", 3)
    assert (namespace, svc) == ("kv", "svc")
    assert domain == VALUE_SETS[value_set].get("clusterDomain", "cluster.local")
    service = services(docs)[name]["spec"]
    # Headless: the name resolves to every ready decode pod's own address,
    # so the port is the decode scheduler's container port itself.
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is False
    assert selects(service["selector"], pod_labels(by_role["decode"]))
    assert not selects(service["selector"], pod_labels(by_role["prefill"]))
    grpc = next(p for p in container(pod_spec(by_role["decode"]), "scheduler")["ports"]
                if p["name"] == "grpc")
    assert int(port) == grpc["containerPort"]
    assert {"name": "grpc", "port": int(port), "targetPort": "grpc", "protocol": "TCP",
            "appProtocol": "grpc"} in service["ports"]


def test_mixed_schedulers_get_no_pd_flags() -> None:
    for value_set in ("defaults", "gpu", "flags"):
        (workload,) = pools(rendered(value_set)).values()
        assert pod_labels(workload)["kvstash.io/role"] == "mixed"
        scheduler = env(container(pod_spec(workload), "scheduler"))
        assert not set(PD_VARIABLES) & set(scheduler), value_set


@pytest.mark.parametrize("value_set", PD_VALUE_SETS)
def test_clients_reach_the_prefill_pool(value_set: str) -> None:
    docs = rendered(value_set)
    by_role = pools(docs)
    by_name = services(docs)
    public = by_name["rel-kvstash"]["spec"]
    assert public["type"] == "ClusterIP"
    assert selects(public["selector"], pod_labels(by_role["prefill"]))
    assert not selects(public["selector"], pod_labels(by_role["decode"]))
    # Headless: every pod of both pools, and each pool's own.
    headless = {n: s["spec"] for n, s in by_name.items() if s["spec"].get("clusterIP") == "None"}
    assert set(headless) == {"rel-kvstash-instances", "rel-kvstash-prefill", "rel-kvstash-decode"}
    for name, spec in headless.items():
        taken = {r for r in ROLES if selects(spec["selector"], pod_labels(by_role[r]))}
        assert taken == ({"prefill", "decode"} if name.endswith("-instances")
                         else {name.removeprefix("rel-kvstash-")}), name
    # helm test generates through the public Service, so through prefill.
    script = one(docs, "Pod")["spec"]["containers"][0]["command"][-1]
    assert "--address rel-kvstash.kv.svc:50051" in script


@pytest.mark.parametrize("value_set", PD_VALUE_SETS)
def test_each_pool_has_its_own_disruption_budget(value_set: str) -> None:
    docs = rendered(value_set)
    by_role = pools(docs)
    budgets = {p["metadata"]["name"]: p["spec"] for p in of_kind(docs, "PodDisruptionBudget")}
    assert set(budgets) == {"rel-kvstash-prefill", "rel-kvstash-decode"}
    pdb = {**DEFAULTS["instances"]["pdb"], **VALUE_SETS[value_set]["instances"].get("pdb", {})}
    for role in ROLES:
        spec = budgets[f"rel-kvstash-{role}"]
        taken = {r for r in ROLES if selects(spec["selector"]["matchLabels"],
                                             pod_labels(by_role[r]))}
        assert taken == {role}
        if pdb["minAvailable"] is None:
            assert spec == {"maxUnavailable": pdb["maxUnavailable"], "selector": spec["selector"]}
        else:
            assert spec == {"minAvailable": pdb["minAvailable"], "selector": spec["selector"]}


def test_service_monitors_scrape_both_pools_by_role() -> None:
    docs = rendered("pd")
    by_role = pools(docs)
    (cache,) = workloads(docs, "cache")
    monitors = {m["metadata"]["name"]: m["spec"] for m in of_kind(docs, "ServiceMonitor")}
    assert set(monitors) == {"rel-kvstash-scheduler", "rel-kvstash-worker", "rel-kvstash-cache"}
    for name, monitor in monitors.items():
        wanted = monitor["selector"]["matchLabels"]
        (service,) = [s for s in of_kind(docs, "Service")
                      if selects(wanted, s["metadata"]["labels"])]
        selector = service["spec"]["selector"]
        if name == "rel-kvstash-cache":  # the one cache pod, which has no role
            assert selects(selector, pod_labels(cache))
            assert "podTargetLabels" not in monitor
            continue
        for role in ROLES:
            assert selects(selector, pod_labels(by_role[role]))
        assert monitor["podTargetLabels"] == ["kvstash.io/role"]
    mixed = {m["metadata"]["name"]: m["spec"] for m in of_kind(rendered("servicemonitor"),
                                                               "ServiceMonitor")}
    assert all(m["podTargetLabels"] == ["kvstash.io/role"] for m in mixed.values())


def test_pools_are_placed_and_sized_on_their_own() -> None:
    values = VALUE_SETS["pd-gpu"]["instances"]
    docs = rendered("pd-gpu")
    prefill, decode = (pod_spec(pools(docs)[r]) for r in ROLES)
    assert prefill["nodeSelector"] == values["prefill"]["nodeSelector"]
    assert prefill["tolerations"] == values["prefill"]["tolerations"]
    assert decode["nodeSelector"] == values["decode"]["nodeSelector"]
    assert decode["tolerations"] == values["tolerations"]  # not its own: the shared ones
    gpu = "nvidia.com/gpu"
    prefill_worker = container(prefill, "worker")["resources"]
    decode_worker = container(decode, "worker")["resources"]
    assert prefill_worker == {k: {**DEFAULTS["worker"]["resources"][k], gpu: 2}
                              for k in ("requests", "limits")}
    assert decode_worker == {k: {**values["decode"]["workerResources"][k], gpu: 1}
                             for k in ("requests", "limits")}
    # The one cache goes where cache.shared says, not where the GPU pools go.
    shared = VALUE_SETS["pd-gpu"]["cache"]["shared"]
    (cache,) = workloads(docs, "cache")
    cache_pod = pod_spec(cache)
    assert cache_pod["nodeSelector"] == shared["nodeSelector"]
    assert cache_pod["tolerations"] == shared["tolerations"]
    assert cache_pod["priorityClassName"] == shared["priorityClassName"]
    assert "affinity" not in cache_pod


def auth_value_sets() -> list[str]:
    return [n for n in PD_VALUE_SETS if VALUE_SETS[n].get("auth", {}).get("enabled")]


def test_some_pd_value_set_has_auth() -> None:
    assert auth_value_sets()  # else the token tests below test nothing


@pytest.mark.parametrize("value_set", auth_value_sets())
def test_prefill_sends_decode_the_token_it_demands(value_set: str) -> None:
    by_role = pools(rendered(value_set))
    secret = VALUE_SETS[value_set]["auth"]["secretName"]
    for role in ROLES:
        pod = pod_spec(by_role[role])
        scheduler = container(pod, "scheduler")
        variables = env(scheduler)
        accepted = variables["KVSTASH_SCHEDULER_AUTH_TOKEN_FILE"]
        # Every scheduler demands a token; the file is the mounted Secret's.
        directory, key = accepted.rsplit("/", 1)
        assert mounts(scheduler)["auth"] == directory
        auth = volumes(pod)["auth"]["secret"]
        assert auth["secretName"] == secret
        assert [item["path"] for item in auth["items"]] == [key]
        if role == "prefill":
            assert variables["KVSTASH_SCHEDULER_TOKEN_FILE"] == accepted
        else:
            assert "KVSTASH_SCHEDULER_TOKEN_FILE" not in variables


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_only_prefill_schedulers_send_a_token(value_set: str) -> None:
    # Mixed instances call no other scheduler: auth on or off, they send none.
    auth = VALUE_SETS[value_set].get("auth", {}).get("enabled", False)
    for role, workload in pools(rendered(value_set)).items():
        scheduler = env(container(pod_spec(workload), "scheduler"))
        sends = "KVSTASH_SCHEDULER_TOKEN_FILE" in scheduler
        assert sends is (auth and role == "prefill"), f"{value_set}: {role}"
