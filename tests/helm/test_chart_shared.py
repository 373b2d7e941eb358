"""helm/kvstash with cache.mode shared: one cache for the whole release, a
StatefulSet of one pod behind a ClusterIP Service that every instance pod of
every pool reaches over gRPC (instances.role pd requires it: a prefill worker
puts each request's KV there, a decode worker restores it). No arena; the
disk tier on the StatefulSet's claim or an emptyDir."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART,
    SHARED_VALUE_SETS,
    VALUE_SETS,
    container,
    env,
    mounts,
    of_kind,
    pod_labels,
    pod_specs,
    rendered,
    selects,
    volumes,
    workloads,
)

DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


def cache_values(value_set: str) -> dict[str, Any]:
    """cache.* as the value set has it over values.yaml (two levels deep)."""
    own = VALUE_SETS[value_set].get("cache", {})
    merged = dict(DEFAULTS["cache"])
    for key, value in own.items():
        merged[key] = {**merged[key], **value} if isinstance(value, dict) else value
    return merged


def mib(quantity: str) -> int:
    return int(quantity[:-2]) * {"Mi": 1, "Gi": 1024}[quantity[-2:]]


def the_cache(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (cache,) = workloads(docs, "cache")
    assert cache["kind"] == "StatefulSet"
    return cache


def cache_service(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The one Service that selects the cache's pod."""
    labels = pod_labels(the_cache(docs))
    (service,) = [s for s in of_kind(docs, "Service") if selects(s["spec"]["selector"], labels)]
    return service


def test_every_mode_has_a_value_set() -> None:
    modes = {cache_values(n)["mode"] for n in VALUE_SETS}
    assert modes == {"sidecar", "daemonset", "shared"}
    assert {VALUE_SETS[n].get("instances", {}).get("role", "mixed")
            for n in SHARED_VALUE_SETS} == {"mixed", "pd"}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_cache_statefulset_and_service_only_in_shared_mode(value_set: str) -> None:
    docs = rendered(value_set)
    c = cache_values(value_set)
    mode = c["mode"] if c["enabled"] else None
    kinds = sorted(w["kind"] for w in workloads(docs, "cache"))
    assert kinds == {"shared": ["StatefulSet"], "daemonset": ["DaemonSet"]}.get(str(mode), [])
    names = {s["metadata"]["name"] for s in of_kind(docs, "Service")}
    assert ("rel-kvstash-cache" in names) is (mode in ("shared", "daemonset"))
    # Only instance pools besides the cache: no other StatefulSet sneaks in.
    instance_statefulsets = [w for w in workloads(docs, "instance") if w["kind"] == "StatefulSet"]
    assert len(of_kind(docs, "StatefulSet")) == len(instance_statefulsets) + (mode == "shared")


@pytest.mark.parametrize("value_set", SHARED_VALUE_SETS)
def test_one_cache_pod_behind_a_cluster_ip_service(value_set: str) -> None:
    docs = rendered(value_set)
    cache = the_cache(docs)
    service = cache_service(docs)
    assert cache["spec"]["replicas"] == 1
    assert cache["spec"]["serviceName"] == service["metadata"]["name"]
    spec = service["spec"]
    # Reachable from every node: not node-local, not headless.
    assert spec["type"] == "ClusterIP" and "clusterIP" not in spec
    assert "internalTrafficPolicy" not in spec
    pod = cache["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["cache"]
    assert not any(selects(spec["selector"], pod_labels(w))
                   for w in workloads(docs, "instance"))


@pytest.mark.parametrize("value_set", SHARED_VALUE_SETS)
def test_every_instance_pod_reaches_the_shared_service(value_set: str) -> None:
    docs = rendered(value_set)
    service = cache_service(docs)
    cache = container(the_cache(docs)["spec"]["template"]["spec"], "cache")
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "cache-grpc"]
    (listening,) = [p for p in cache["ports"] if p["name"] == grpc["targetPort"]]
    assert env(cache)["KVSTASH_CACHE_LISTEN"] == f"0.0.0.0:{listening['containerPort']}"
    assert grpc["port"] == listening["containerPort"] == cache_values(value_set)["port"]
    expected = f"{service['metadata']['name']}.kv.svc:{grpc['port']}"
    pools = workloads(docs, "instance")
    assert len(pools) == (2 if VALUE_SETS[value_set].get("instances", {}).get("role") == "pd"
                          else 1)
    for workload in pools:
        pod = workload["spec"]["template"]["spec"]
        assert [c["name"] for c in pod["containers"]] == ["scheduler", "worker"]
        for name in ("scheduler", "worker"):
            address = env(container(pod, name))[f"KVSTASH_{name.upper()}_CACHE_ADDRESS"]
            assert address == expected, f"{workload['metadata']['name']} {name}"


@pytest.mark.parametrize("value_set", SHARED_VALUE_SETS)
def test_no_arena_in_shared_mode(value_set: str) -> None:
    docs = rendered(value_set)
    assert cache_values(value_set)["arena"]["enabled"]  # on in values, ignored here
    for spec in pod_specs(docs):
        for volume in spec.get("volumes", []):
            assert volume["name"] != "arena"
            assert "hostPath" not in volume
            assert volume.get("emptyDir", {}).get("medium") != "Memory", volume
        for c in spec["containers"]:
            assert "arena" not in mounts(c)
            assert not any("ARENA_DIR" in name for name in env(c)), c["name"]
    for workload in workloads(docs, "instance"):
        worker = container(workload["spec"]["template"]["spec"], "worker")
        assert env(worker)["KVSTASH_WORKER_CACHE_ARENA"] == "false"  # streams over gRPC


@pytest.mark.parametrize("value_set", SHARED_VALUE_SETS)
def test_shared_cache_memory_fits_its_limit(value_set: str) -> None:
    c = cache_values(value_set)
    cache = container(the_cache(rendered(value_set))["spec"]["template"]["spec"], "cache")
    assert env(cache)["KVSTASH_CACHE_MEMORY_BUDGET"] == f"{mib(c['memoryBudget'])}MiB"
    limit = cache["resources"]["limits"]["memory"]
    assert mib(limit) == mib(c["memoryBudget"]) + mib(c["overhead"])


@pytest.mark.parametrize("value_set", SHARED_VALUE_SETS)
def test_shared_cache_disk_tier_on_a_claim_or_an_empty_dir(value_set: str) -> None:
    docs = rendered(value_set)
    disk = cache_values(value_set)["disk"]
    cache = the_cache(docs)
    pod = cache["spec"]["template"]["spec"]
    variables = env(container(pod, "cache"))
    claims = cache["spec"].get("volumeClaimTemplates", [])
    if not disk["enabled"]:
        assert "KVSTASH_CACHE_DISK_DIR" not in variables and not claims
        return
    assert variables["KVSTASH_CACHE_DISK_DIR"] == mounts(container(pod, "cache"))["disk"]
    if disk["persistence"]["enabled"]:
        (claim,) = claims
        assert claim["metadata"]["name"] == "disk" and "disk" not in volumes(pod)
        assert mib(claim["spec"]["resources"]["requests"]["storage"]) >= mib(disk["budget"])
    else:
        assert not claims
        assert mib(volumes(pod)["disk"]["emptyDir"]["sizeLimit"]) >= mib(disk["budget"])
    # The claim is the cache's: the instances stay Deployments without one.
    for workload in workloads(docs, "instance"):
        assert workload["kind"] == "Deployment"
        assert "disk" not in volumes(workload["spec"]["template"]["spec"])


def test_some_shared_value_sets_cover_each_disk_tier() -> None:
    tiers = {(d["enabled"], d["persistence"]["enabled"])
             for d in (cache_values(n)["disk"] for n in SHARED_VALUE_SETS)}
    assert {(True, True), (True, False), (False, False)} <= tiers


def test_shared_cache_speaks_mutual_tls() -> None:
    value_set = "pd-disk-pvc-tls-auth"
    docs = rendered(value_set)
    pod = the_cache(docs)["spec"]["template"]["spec"]
    cache = container(pod, "cache")
    assert volumes(pod)["tls"]["secret"]["secretName"] == VALUE_SETS[value_set]["tls"][
        "secretName"]
    tls_dir = mounts(cache)["tls"]
    variables = env(cache)
    assert {k: variables[f"KVSTASH_CACHE_TLS_{k}"] for k in ("CERT", "KEY", "CA")} == {
        "CERT": f"{tls_dir}/tls.crt", "KEY": f"{tls_dir}/tls.key", "CA": f"{tls_dir}/ca.crt"}
    assert "KVSTASH_CACHE_PLAINTEXT" not in variables
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert cache[probe]["exec"]["command"][0] == "kvstash-health"


def test_shared_cache_goes_where_cache_shared_says() -> None:
    shared = VALUE_SETS["shared"]["cache"]["shared"]
    cache = the_cache(rendered("shared"))
    pod = cache["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == shared["nodeSelector"]
    assert cache["spec"]["template"]["metadata"]["annotations"] == shared["podAnnotations"]
    assert "tolerations" not in pod and "priorityClassName" not in pod
