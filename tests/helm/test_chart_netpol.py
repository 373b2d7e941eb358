"""helm/kvstash with networkPolicy.enabled: one ingress-only NetworkPolicy per
workload, each selecting exactly that workload's pods and admitting, port by
port, only the peers that call that port: the gateway and the helm test pod
(and networkPolicy.clients) to the public schedulers, prefill pods to decode
schedulers, instance pods to a cache outside them, and networkPolicy
.gatewayClients / .metricsFrom (or any source) to the gateway and metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chart_helpers import (
    VALUE_SETS,
    container,
    env,
    of_kind,
    pod_labels,
    render,
    rendered,
    selects,
    workloads,
)

NETPOL_VALUE_SETS = sorted(name for name, values in VALUE_SETS.items()
                           if values.get("networkPolicy", {}).get("enabled"))
GATEWAY = "rel-kvstash-gateway"
TEST_POD = "rel-kvstash-test"

Peer = dict[str, Any]


def policies(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p["spec"] for p in of_kind(docs, "NetworkPolicy")}


def release_pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Workload name (or the helm test pod's name) -> its pods' labels."""
    pods = {d["metadata"]["name"]: pod_labels(d) for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")}
    pods.update({d["metadata"]["name"]: d["metadata"]["labels"] for d in of_kind(docs, "Pod")})
    return pods


def admitted(docs: list[dict[str, Any]], policy: str,
             port: int) -> tuple[set[str], list[Peer]] | None:
    """Who `policy` admits on TCP `port`: None for any source, else the
    release's pods its peers select (by workload name) and, apart, the peers
    that select none of them (namespaces, address ranges, other pods)."""
    rules = [r for r in policies(docs)[policy]["ingress"]
             if {"port": port, "protocol": "TCP"} in r["ports"]]
    assert rules, f"{policy} admits nothing on port {port}"
    if any("from" not in r for r in rules):
        return None
    pods = release_pods(docs)
    inside: set[str] = set()
    outside: list[Peer] = []
    for peer in (p for r in rules for p in r["from"]):
        matched = set()
        if set(peer) == {"podSelector"}:  # pods of the policy's own namespace
            wanted = peer["podSelector"].get("matchLabels", {})
            matched = {name for name, labels in pods.items() if selects(wanted, labels)}
        inside |= matched
        if not matched:
            outside.append(peer)
    return inside, outside


def container_ports(workload: dict[str, Any]) -> dict[str, int]:
    """Port name -> number, over the pod's containers."""
    return {p["name"]: p["containerPort"] for c in workload["spec"]["template"]["spec"]
            ["containers"] for p in c.get("ports", [])}


def network_policy(value_set: str) -> dict[str, Any]:
    return {"clients": [], "gatewayClients": [], "metricsFrom": [],
            **VALUE_SETS[value_set]["networkPolicy"]}


@pytest.mark.parametrize("value_set", sorted(set(VALUE_SETS) - set(NETPOL_VALUE_SETS)))
def test_nothing_rendered_when_disabled(value_set: str) -> None:
    assert not of_kind(rendered(value_set), "NetworkPolicy")


@pytest.mark.parametrize("value_set", NETPOL_VALUE_SETS)
def test_each_policy_selects_its_own_workloads_pods(value_set: str) -> None:
    docs = rendered(value_set)
    pods = release_pods(docs)
    found = policies(docs)
    # Every workload is guarded; the test pod, which serves nothing, is not.
    assert set(found) == set(pods) - {TEST_POD}
    for name, spec in found.items():
        chosen = {n for n, labels in pods.items()
                  if selects(spec["podSelector"]["matchLabels"], labels)}
        assert chosen == {name}, name
        # Only this release's pods, whatever other releases run beside it.
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "rel"
        assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec, name


@pytest.mark.parametrize("value_set", NETPOL_VALUE_SETS)
def test_ports_admitted_are_those_served_beyond_loopback(value_set: str) -> None:
    """The worker's port, and the cache's in sidecar mode, are called on
    loopback only; every other port a pod serves has a rule."""
    docs = rendered(value_set)
    found = policies(docs)
    for workload in (d for d in docs if d["metadata"]["name"] in found
                     and d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")):
        spec = found[workload["metadata"]["name"]]
        served = container_ports(workload)
        loopback = {"worker-grpc"}
        if pod_labels(workload)["app.kubernetes.io/component"] == "instance":
            loopback.add("cache-grpc")
        ruled = [p["port"] for rule in spec["ingress"] for p in rule["ports"]]
        assert sorted(ruled) == sorted(port for name, port in served.items()
                                       if name not in loopback), workload["metadata"]["name"]


@pytest.mark.parametrize("value_set", NETPOL_VALUE_SETS)
def test_public_schedulers_admit_the_gateway_the_test_pod_and_clients(value_set: str) -> None:
    docs = rendered(value_set)
    gateway = VALUE_SETS[value_set].get("gateway", {}).get("enabled", False)
    by_role = {pod_labels(w)["kvstash.io/role"]: w for w in workloads(docs, "instance")}
    entry = by_role.get("mixed") or by_role["prefill"]
    port = container_ports(entry)["grpc"]
    assert admitted(docs, entry["metadata"]["name"], port) == (
        {TEST_POD} | ({GATEWAY} if gateway else set()), network_policy(value_set)["clients"])
    # ...on the port they call: the public Service's target, the gateway's discovery port.
    (public,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == "rel-kvstash"]
    assert public["spec"]["ports"][0]["targetPort"] == "grpc"
    assert selects(public["spec"]["selector"], pod_labels(entry))
    if gateway:
        (smg,) = workloads(docs, "gateway")
        args = container(smg["spec"]["template"]["spec"], "gateway")["args"]
        assert args[args.index("--service-discovery-port") + 1] == str(port)


def test_decode_schedulers_admit_prefill_pods_only() -> None:
    docs = rendered("network-policy-pd-shared")
    by_role = {pod_labels(w)["kvstash.io/role"]: w for w in workloads(docs, "instance")}
    port = container_ports(by_role["decode"])["grpc"]
    assert admitted(docs, "rel-kvstash-decode", port) == ({"rel-kvstash-prefill"}, [])
    # The port prefill schedulers hand requests to (--decode-address).
    scheduler = container(by_role["prefill"]["spec"]["template"]["spec"], "scheduler")
    assert env(scheduler)["KVSTASH_SCHEDULER_DECODE_ADDRESS"].endswith(f":{port}")


def test_shared_cache_admits_instance_pods_only() -> None:
    docs = rendered("network-policy-pd-shared")
    (cache,) = workloads(docs, "cache")
    port = container_ports(cache)["cache-grpc"]
    assert port == VALUE_SETS["network-policy-pd-shared"]["cache"]["port"]
    assert admitted(docs, cache["metadata"]["name"], port) == (
        {"rel-kvstash-prefill", "rel-kvstash-decode"}, [])


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_cache_modes_without_gateway_or_clients(mode: str, tmp_path: Path) -> None:
    """A daemonset cache is reached through its node-local Service from the
    instance pods' own addresses; a sidecar cache needs no policy. With no
    gateway and no clients, only the helm test pod calls the schedulers."""
    docs = render({"cache": {"mode": mode}, "networkPolicy": {"enabled": True}}, tmp_path)
    expected = {"rel-kvstash"} | ({"rel-kvstash-cache"} if mode == "daemonset" else set())
    assert set(policies(docs)) == expected
    assert admitted(docs, "rel-kvstash", 50051) == ({TEST_POD}, [])
    if mode == "daemonset":
        assert admitted(docs, "rel-kvstash-cache", 50071) == ({"rel-kvstash"}, [])


def test_gateway_admits_its_clients_and_the_test_pod(tmp_path: Path) -> None:
    docs = rendered("network-policy")
    port = VALUE_SETS["network-policy"]["gateway"]["port"]
    assert admitted(docs, GATEWAY, port) == (
        {TEST_POD}, network_policy("network-policy")["gatewayClients"])
    # No gatewayClients: the front door is open to any source.
    docs = render({"gateway": {"enabled": True}, "networkPolicy": {"enabled": True}}, tmp_path)
    assert admitted(docs, GATEWAY, 8000) is None


@pytest.mark.parametrize("value_set", NETPOL_VALUE_SETS)
def test_metrics_ports_admit_metrics_from(value_set: str) -> None:
    docs = rendered(value_set)
    metrics_from = network_policy(value_set)["metricsFrom"]
    for workload in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        for name, port in container_ports(workload).items():
            if name.startswith("metrics-"):
                got = admitted(docs, workload["metadata"]["name"], port)
                assert got == ((set(), metrics_from) if metrics_from else None), name
