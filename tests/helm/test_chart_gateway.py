"""helm/kvstash with the smg gateway (gateway.enabled): what it renders, and
that smg's own launcher accepts every argument the chart gives it (a dry
launch: smg's parser, its checks and the router's construction, never its
start), so chart and smg cannot drift apart."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART,
    GATEWAY_VALUE_SETS,
    VALUE_SETS,
    container,
    env,
    of_kind,
    one,
    pod_labels,
    pools,
    render,
    rendered,
    selects,
    workloads,
)

GATEWAY = "rel-kvstash-gateway"
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
SMG_HINT = "pip install -e '.[dev,gateway]'  (make test does)"


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`, maps merged key by key as Helm merges values."""
    out = dict(base)
    for key, value in override.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = merged(base[key], value) if both else value
    return out


def values_of(value_set: str) -> dict[str, Any]:
    return merged(DEFAULTS, VALUE_SETS[value_set])


def gateway_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = workloads(docs, "gateway")
    assert deployment["kind"] == "Deployment" and deployment["metadata"]["name"] == GATEWAY
    return deployment


def gateway_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    c = container(gateway_deployment(docs)["spec"]["template"]["spec"], "gateway")
    assert c["command"] == ["smg", "launch"]
    return c


def smg_parser() -> argparse.ArgumentParser:
    """The parser `smg launch` builds (smg/launch_router.py: parse_router_args)."""
    try:
        from smg.router_args import RouterArgs
    except ModuleNotFoundError:
        pytest.fail(f"smg is not installed: {SMG_HINT}")
    parser = argparse.ArgumentParser(prog="smg launch")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return parser


def dry_launch(args: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    """What `smg launch <args>` does before it starts the router: parse,
    resolve the discovery provider (which turns IGW mode on), validate, and
    build the router from the result. Nothing listens. Returns smg's RouterArgs."""
    from smg.launch_router import parse_router_args
    from smg.router import Router

    unknown = [a for a in args if a.startswith("--")
               and a not in smg_parser()._option_string_actions]
    assert not unknown, f"smg launch has no flags {unknown} (abbreviations included)"
    try:
        router_args = parse_router_args(args)
    except SystemExit:
        pytest.fail(f"smg refuses the chart's arguments: {capsys.readouterr().err}")
    if router_args.selected_discovery_provider() and not router_args.enable_igw:
        router_args.enable_igw = True
    router_args._validate_router_args()
    Router.from_args(router_args)
    return router_args


@pytest.mark.parametrize("value_set", GATEWAY_VALUE_SETS)
def test_smg_accepts_what_the_chart_passes(value_set: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    values = values_of(value_set)
    g = values["gateway"]
    docs = rendered(value_set)
    c = gateway_container(docs)
    parsed = dry_launch(c["args"], capsys)
    assert parsed.policy == g["policy"]
    assert (parsed.host, parsed.port) == ("0.0.0.0", g["port"])
    assert parsed.cache_threshold == g["cacheAware"]["cacheThreshold"]
    assert parsed.balance_abs_threshold == g["cacheAware"]["balanceAbsThreshold"]
    assert parsed.balance_rel_threshold == g["cacheAware"]["balanceRelThreshold"]
    assert parsed.health_check_interval_secs == g["healthCheck"]["intervalSeconds"]
    assert parsed.health_failure_threshold == g["healthCheck"]["failureThreshold"]
    assert parsed.log_level == g["logLevel"]
    # smg drains in-flight requests, then exits before the kubelet kills it.
    pod = gateway_deployment(docs)["spec"]["template"]["spec"]
    assert parsed.shutdown_grace_period_secs == g["shutdownGracePeriodSeconds"]
    assert pod["terminationGracePeriodSeconds"] == parsed.shutdown_grace_period_secs + 5
    for flag, value in g["flags"].items():
        assert getattr(parsed, flag.replace("-", "_")) == value, flag
    tracing = values["tracing"]
    assert parsed.enable_trace is tracing["enabled"]
    if tracing["enabled"]:
        assert parsed.otlp_traces_endpoint == tracing["endpoint"]


@pytest.mark.parametrize("value_set", GATEWAY_VALUE_SETS)
def test_gateway_discovers_the_pool_clients_call(
    value_set: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """Kubernetes discovery of the pods the public Service selects (mixed, or
    prefill with pd: never decode), in the release's namespace, at the
    scheduler's gRPC port; no static worker list, no smg P/D mode."""
    values = values_of(value_set)
    docs = rendered(value_set)
    parsed = dry_launch(gateway_container(docs)["args"], capsys)
    assert parsed.selected_discovery_provider() == "kubernetes"
    assert parsed.service_discovery_namespace == "kv"
    assert parsed.worker_urls == [] and not parsed.pd_disaggregation
    by_role = pools(docs)
    entry = "prefill" if values["instances"]["role"] == "pd" else "mixed"
    assert set(by_role) == ({"prefill", "decode"} if entry == "prefill" else {"mixed"})
    for role, workload in by_role.items():
        assert selects(parsed.selector, pod_labels(workload)) is (role == entry), role
    public = one([s for s in of_kind(docs, "Service") if s["metadata"]["name"] == "rel-kvstash"],
                 "Service")
    assert parsed.selector == public["spec"]["selector"]
    scheduler = container(by_role[entry]["spec"]["template"]["spec"], "scheduler")
    grpc_port = next(p["containerPort"] for p in scheduler["ports"] if p["name"] == "grpc")
    assert parsed.service_discovery_port == grpc_port == values["scheduler"]["port"]


@pytest.mark.parametrize("value_set", GATEWAY_VALUE_SETS)
def test_probes_and_service_use_the_http_port(value_set: str) -> None:
    g = values_of(value_set)["gateway"]
    docs = rendered(value_set)
    c = gateway_container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(c["args"][c["args"].index("--port") + 1]) == g["port"]
    paths = {"startupProbe": "/readiness", "readinessProbe": "/readiness",
             "livenessProbe": "/liveness"}
    for kind, path in paths.items():
        probe = c[kind]
        assert probe["httpGet"] == {"path": path, "port": "http"}, kind
        timing = g["probes"][kind.removesuffix("Probe")]
        assert {k: probe[k] for k in timing} == timing, kind
    (service,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == GATEWAY]
    spec = service["spec"]
    assert spec["type"] == g["service"]["type"]
    assert service["metadata"].get("annotations", {}) == g["service"]["annotations"]
    assert spec["ports"][0] == {"name": "http", "port": g["service"]["port"], "targetPort": "http",
                                "protocol": "TCP", "appProtocol": "http"}
    pod_sets = {d["metadata"]["name"]: pod_labels(d) for d in docs
                if d["kind"] in ("Deployment", "StatefulSet")}
    assert {n for n, labels in pod_sets.items() if selects(spec["selector"], labels)} == {GATEWAY}


@pytest.mark.parametrize("value_set", GATEWAY_VALUE_SETS)
def test_gateway_metrics_bind_where_they_are_scraped(value_set: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    values = values_of(value_set)
    docs = rendered(value_set)
    c = gateway_container(docs)
    parsed = dry_launch(c["args"], capsys)
    assert parsed.prometheus_port == values["metrics"]["ports"]["gateway"]
    (service,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == GATEWAY]
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    monitors = [m for m in of_kind(docs, "ServiceMonitor")
                if m["metadata"]["name"] == GATEWAY]
    if values["metrics"]["enabled"]:
        assert parsed.prometheus_host == "0.0.0.0"
        (port,) = [p for p in c["ports"] if p["name"] == "metrics-gateway"]
        assert port["containerPort"] == parsed.prometheus_port
        assert service_ports["metrics-gateway"]["targetPort"] == "metrics-gateway"
        (monitor,) = monitors
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics-gateway"
    else:  # smg serves /metrics anyway: on loopback only
        assert parsed.prometheus_host == "127.0.0.1"
        assert [p["name"] for p in c["ports"]] == ["http"] and set(service_ports) == {"http"}
        assert not monitors


@pytest.mark.parametrize("value_set", GATEWAY_VALUE_SETS)
def test_gateway_pod_is_locked_down_and_needs_no_gpu(value_set: str) -> None:
    g = values_of(value_set)["gateway"]
    deployment = gateway_deployment(rendered(value_set))
    assert deployment["spec"]["replicas"] == g["replicas"]
    pod = deployment["spec"]["template"]["spec"]
    c = container(pod, "gateway")
    assert c["image"] == "kvstash-gateway:0.1.0"
    assert c["resources"] == g["resources"]
    assert not any("gpu" in k for part in c["resources"].values() for k in part)
    assert pod.get("nodeSelector", {}) == g["nodeSelector"]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Writable: /tmp alone. Tokenizers come from the schedulers, never the Hub.
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert env(c)["HF_ENDPOINT"] == "http://127.0.0.1:9"
    # The one pod with a service-account token: smg lists and watches pods with it.
    assert pod["automountServiceAccountToken"] is True
    assert pod["serviceAccountName"] == GATEWAY


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_rbac_only_with_the_gateway_and_only_namespaced(value_set: str) -> None:
    docs = rendered(value_set)
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")
    roles, bindings = of_kind(docs, "Role"), of_kind(docs, "RoleBinding")
    accounts = {a["metadata"]["name"]: a for a in of_kind(docs, "ServiceAccount")}
    if value_set not in GATEWAY_VALUE_SETS:
        assert not roles and not bindings and GATEWAY not in accounts
        return
    (role,) = roles
    (binding,) = bindings
    assert role["metadata"]["name"] == GATEWAY
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": GATEWAY}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": GATEWAY,
                                    "namespace": "kv"}]
    # Its own account, closed by default: only the gateway pod opts in.
    assert accounts[GATEWAY]["automountServiceAccountToken"] is False
    instance_pods = [w["spec"]["template"]["spec"] for w in workloads(docs, "instance")]
    assert all(p["serviceAccountName"] != GATEWAY for p in instance_pods)


@pytest.mark.parametrize("value_set", sorted(set(VALUE_SETS) - set(GATEWAY_VALUE_SETS)))
def test_nothing_of_the_gateway_when_disabled(value_set: str) -> None:
    docs = rendered(value_set)
    assert not [d["kind"] for d in docs if "gateway" in d["metadata"]["name"]
                or d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "gateway"]
    assert [c["name"] for c in one(docs, "Pod")["spec"]["containers"]] == ["generate"]


def test_gateway_settings_wait_for_gateway_enabled(tmp_path: Path) -> None:
    # Even settings gateway.enabled would refuse render nothing while it is off.
    docs = render({"gateway": {"replicas": 0, "flags": {"log-json": True}},
                   "instances": {"replicas": 0}}, tmp_path)
    assert not [d for d in docs if "gateway" in d["metadata"]["name"]]


def test_gateway_disruption_budget_needs_two_replicas(tmp_path: Path) -> None:
    budgets = {p["metadata"]["name"]: p["spec"]
               for p in of_kind(rendered("gateway"), "PodDisruptionBudget")}
    gateway_pods = pod_labels(gateway_deployment(rendered("gateway")))
    assert budgets[GATEWAY]["maxUnavailable"] == 1
    assert selects(budgets[GATEWAY]["selector"]["matchLabels"], gateway_pods)
    for name, spec in budgets.items():  # the instances' budgets leave the gateway alone
        assert selects(spec["selector"]["matchLabels"], gateway_pods) is (name == GATEWAY)
    assert GATEWAY not in {p["metadata"]["name"]
                           for p in of_kind(rendered("gateway-pd"), "PodDisruptionBudget")}
    docs = render({"gateway": {"enabled": True, "replicas": 3,
                               "pdb": {"minAvailable": 2, "maxUnavailable": None}}}, tmp_path)
    (spec,) = [p["spec"] for p in of_kind(docs, "PodDisruptionBudget")
               if p["metadata"]["name"] == GATEWAY]
    assert spec["minAvailable"] == 2 and "maxUnavailable" not in spec


@pytest.mark.parametrize("value_set", GATEWAY_VALUE_SETS)
def test_helm_test_checks_the_gateway_over_http(value_set: str) -> None:
    values = values_of(value_set)
    pod = one(rendered(value_set), "Pod")
    assert [c["name"] for c in pod["spec"]["containers"]] == ["generate", "gateway"]
    c = container(pod["spec"], "gateway")
    assert c["image"] == "kvstash:0.1.0"  # the control image: python, no curl
    assert env(c)["GATEWAY_URL"] == (
        f"http://{GATEWAY}.kv.svc:{values['gateway']['service']['port']}")
    assert (env(c)["PROMPT"], env(c)["MAX_TOKENS"]) == (
        values["tests"]["prompt"], str(values["tests"]["maxTokens"]))
    python, flag, script = c["command"]
    assert (python, flag) == ("python", "-c")
    assert script.strip() == (CHART / "files" / "gateway-check.py").read_text().strip()
    imported = {alias.name for node in ast.walk(ast.parse(script))
                if isinstance(node, ast.Import) for alias in node.names}
    assert imported == {"json", "os", "time", "urllib.request"}
    assert not [n for n in ast.walk(ast.parse(script)) if isinstance(n, ast.ImportFrom)]
