"""helm/kvstash: lint, render every value set, validate every manifest
against the Kubernetes schemas (strict), and check what the pods must get
right: the shared arena, GPU placement, probes, pod security, services."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART,
    INSTALL_HINT,
    PD_VALUE_SETS,
    VALUE_SETS,
    container,
    env,
    helm,
    instances,
    kube_versions,
    mounts,
    of_kind,
    one,
    pod_labels,
    pod_specs,
    render,
    rendered,
    volumes,
)

from cache_svc.config import IDLE_PROCESS_BYTES, CacheConfig
from kvstash.common.units import MIB

try:
    import kubernetes_validate
except ModuleNotFoundError:  # fails the validation test below, naming the fix
    kubernetes_validate = None

SERVICE_CONTAINERS = ("scheduler", "worker", "cache")
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


def test_lint_passes_for_every_value_set(tmp_path: Path) -> None:
    for name, values in VALUE_SETS.items():
        done = helm("lint", "--strict", str(CHART), values=values, tmp_path=tmp_path)
        assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_manifest_validates_strictly(value_set: str) -> None:
    if kubernetes_validate is None:
        pytest.fail(f"kubernetes-validate is not installed: {INSTALL_HINT}")
    for version in kube_versions(value_set):
        docs = rendered(value_set, version)
        assert {"Deployment", "StatefulSet"} & {d["kind"] for d in docs}
        for doc in docs:
            if doc["kind"] in ("ServiceMonitor", "PrometheusRule"):
                # CRDs: no schema ships for them.
                (check_service_monitor if doc["kind"] == "ServiceMonitor"
                 else check_prometheus_rule)(doc, docs)
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(map(str, exc.path))
                pytest.fail(f"{value_set} on {version}: {doc['kind']} "
                            f"{doc['metadata']['name']}: {path}: {exc.message}")


def check_service_monitor(monitor: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    """Its shape, and that it selects a rendered Service with the port it scrapes."""
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) - {"podTargetLabels"} == {
        "selector", "namespaceSelector", "endpoints"}
    wanted = monitor["spec"]["selector"]["matchLabels"]
    services = [s for s in of_kind(docs, "Service")
                if wanted.items() <= s["metadata"]["labels"].items()]
    assert len(services) == 1, f"{monitor['metadata']['name']} selects {len(services)} Services"
    ports = {p["name"] for p in services[0]["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) == {"port", "path", "interval", "scrapeTimeout"}
        assert endpoint["port"] in ports


def check_prometheus_rule(rule: dict[str, Any], _docs: list[dict[str, Any]]) -> None:
    """The rules file as it is, as the spec of a monitoring.coreos.com/v1 PrometheusRule."""
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    for group in rule["spec"]["groups"]:
        for alert in group["rules"]:
            assert set(alert) == {"alert", "expr", "for", "labels", "annotations"}


def test_monitoring_ships_the_dashboard_and_the_alert_rules() -> None:
    """Off by default; on, the dashboard as a ConfigMap Grafana's sidecar
    finds (its label, the folder annotation) holding the file byte for byte,
    and one PrometheusRule with the labels Prometheus selects rules by."""
    assert not of_kind(rendered("defaults"), "PrometheusRule")
    assert not [c for c in of_kind(rendered("servicemonitor"), "ConfigMap")
                if "grafana_dashboard" in c["metadata"]["labels"]]
    docs = rendered("monitoring")
    (board,) = [c for c in of_kind(docs, "ConfigMap")
                if c["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert board["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}
    assert board["data"]["kvstash.json"] == (CHART / "files" / "grafana-dashboard.json").read_text()
    assert one(docs, "PrometheusRule")["metadata"]["labels"]["release"] == "prometheus"


def test_service_monitors_cover_every_metrics_endpoint() -> None:
    for name in ("servicemonitor", "daemonset", "shared", "pd", "gateway"):
        docs = rendered(name)
        scraped = {m["spec"]["endpoints"][0]["port"] for m in of_kind(docs, "ServiceMonitor")}
        served = {p["name"] for spec in pod_specs(docs) for c in spec["containers"]
                  for p in c.get("ports", []) if p["name"].startswith("metrics-")}
        gateway = {"metrics-gateway"} if name == "gateway" else set()
        assert scraped == served == {"metrics-sched", "metrics-worker", "metrics-cache"} | gateway
    assert not of_kind(rendered("defaults"), "ServiceMonitor")


def test_the_default_cache_overhead_covers_the_caches_own_bound() -> None:
    """The chart's memory limit is memoryBudget + overhead: an overhead under
    what the cache may hold beyond its budget (at the flags the chart passes,
    the cache's defaults) lets the kernel kill a cache at its bound."""
    bound = IDLE_PROCESS_BYTES + CacheConfig().overhead_bytes()
    assert mib(DEFAULTS["cache"]["overhead"]) * MIB >= bound


@pytest.mark.parametrize("value_set", ["defaults", "daemonset"])
def test_worker_maps_the_arena_the_cache_allocates(value_set: str) -> None:
    docs = rendered(value_set)
    cache, worker = (next(c for s in pod_specs(docs) for c in s["containers"] if c["name"] == n)
                     for n in ("cache", "worker"))
    arena_dir = env(cache)["KVSTASH_CACHE_ARENA_DIR"]
    # The worker opens the path the cache reports: one directory, one path.
    assert mounts(cache)["arena"] == mounts(worker)["arena"] == arena_dir
    assert env(worker)["KVSTASH_WORKER_CACHE_ARENA"] == "true"
    budget = VALUE_SETS[value_set].get("cache", {}).get("memoryBudget", DEFAULTS["cache"]
                                                        ["memoryBudget"])
    assert env(cache)["KVSTASH_CACHE_MEMORY_BUDGET"] == f"{mib(budget)}MiB"
    assert mib(cache["resources"]["limits"]["memory"]) >= mib(budget) + mib(
        DEFAULTS["cache"]["overhead"])
    pod = instances(docs)["spec"]["template"]["spec"]
    if value_set == "defaults":
        arena = volumes(pod)["arena"]["emptyDir"]
        assert arena["medium"] == "Memory" and mib(arena["sizeLimit"]) >= mib(budget)
        assert env(worker)["KVSTASH_WORKER_CACHE_ADDRESS"] == "127.0.0.1:50071"
    else:
        cache_pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
        host_dir = volumes(cache_pod)["arena"]["hostPath"]["path"]
        assert volumes(pod)["arena"]["hostPath"]["path"] == host_dir
        local = one([s for s in of_kind(docs, "Service") if "cache" in s["metadata"]["name"]],
                    "Service")
        assert local["spec"]["internalTrafficPolicy"] == "Local"
        assert env(worker)["KVSTASH_WORKER_CACHE_ADDRESS"] == (
            f"{local['metadata']['name']}.kv.svc:50071")
    # Same user in both: the arena file is 0600.
    assert pod["securityContext"]["runAsUser"] == cache["securityContext"]["runAsUser"] == (
        worker["securityContext"]["runAsUser"])


def test_releases_on_one_node_never_share_an_arena_directory(tmp_path: Path) -> None:
    """cache.mode daemonset: every pod of every release runs as runAsUser, so
    releases sharing the node directory could read and overwrite each
    other's KV. Each gets its own (names that would run together included),
    unless cache.daemonset.hostPath names one."""

    def host_dirs(release: str, namespace: str, daemonset: dict[str, Any]) -> set[str]:
        docs = render({"cache": {"mode": "daemonset", "daemonset": daemonset}}, tmp_path,
                      release=release, namespace=namespace)
        pods = [one(docs, "DaemonSet")["spec"]["template"]["spec"],
                instances(docs)["spec"]["template"]["spec"]]
        return {volumes(pod)["arena"]["hostPath"]["path"] for pod in pods}

    releases = [("a", "team-a"), ("b", "team-b"), ("a", "team-b"), ("a-x", "team"),
                ("x", "team-a")]
    dirs = [host_dirs(release, namespace, {}) for release, namespace in releases]
    assert all(len(d) == 1 for d in dirs), dirs  # the cache's and the instances' alike
    assert len(set.union(*dirs)) == len(releases), dirs
    assert dirs[0] == {"/dev/shm/kvstash_team-a_a"}
    assert host_dirs("a", "team-a", {"hostPath": "/mnt/kv"}) == {"/mnt/kv"}


def test_no_arena_streams_and_no_cache_recomputes() -> None:
    docs = rendered("no-arena")
    pod = instances(docs)["spec"]["template"]["spec"]
    assert "arena" not in volumes(pod)
    assert "KVSTASH_CACHE_ARENA_DIR" not in env(container(pod, "cache"))
    assert env(container(pod, "worker"))["KVSTASH_WORKER_CACHE_ARENA"] == "false"
    pod = instances(rendered("no-cache"))["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["scheduler", "worker"]
    assert env(container(pod, "scheduler"))["KVSTASH_SCHEDULER_CACHE_ADDRESS"] == ""


def mib(quantity: str) -> int:
    number, unit = quantity[:-2], quantity[-2:]
    return int(number) * {"Mi": 1, "Gi": 1024}[unit]


@pytest.mark.parametrize("value_set", ["no-pvc", "disk-pvc"])
def test_disk_tier_volume_matches_its_flags(value_set: str) -> None:
    docs = rendered(value_set)
    workload = instances(docs)
    cache = container(workload["spec"]["template"]["spec"], "cache")
    disk = VALUE_SETS[value_set]["cache"]["disk"]
    assert env(cache)["KVSTASH_CACHE_DISK_DIR"] == mounts(cache)["disk"]
    assert env(cache)["KVSTASH_CACHE_DISK_BUDGET"] == f"{mib(disk['budget'])}MiB"
    if value_set == "disk-pvc":
        assert workload["kind"] == "StatefulSet"
        assert workload["spec"]["serviceName"].endswith("-instances")
        (claim,) = workload["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "disk"
        assert claim["spec"]["storageClassName"] == "fast-ssd"
        assert claim["spec"]["resources"]["requests"]["storage"] == f"{mib('25Gi')}Mi"
    else:
        assert workload["kind"] == "Deployment"
        pod = workload["spec"]["template"]["spec"]
        assert mib(volumes(pod)["disk"]["emptyDir"]["sizeLimit"]) >= mib(disk["budget"])
        assert not of_kind(docs, "PersistentVolumeClaim")


def worker_gpus(values: dict[str, Any], role: str | None) -> int:
    """GPUs a worker of the pool `role` should request under `values`."""
    count: int = values.get("worker", {}).get("gpu", {}).get("count", 0)
    own = values.get("instances", {}).get(role, {}).get("gpuCount") if role else None
    return count if own is None else int(own)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_only_the_worker_requests_gpus(value_set: str) -> None:
    docs = rendered(value_set)
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet", "DaemonSet", "Pod"):
            continue
        spec = d["spec"] if d["kind"] == "Pod" else d["spec"]["template"]["spec"]
        role = pod_labels(d).get("kvstash.io/role") if d["kind"] != "Pod" else None
        for c in spec["containers"] + spec.get("initContainers", []):
            resources = c.get("resources", {})
            gpus = [resources.get(k, {}).get("nvidia.com/gpu") for k in ("requests", "limits")]
            count = worker_gpus(VALUE_SETS[value_set], role) if c["name"] == "worker" else 0
            expected = [count, count] if count else [None, None]
            assert gpus == expected, f"{value_set}: {c['name']} ({role}) asks for {gpus}"


def test_gpu_instances_go_to_gpu_nodes() -> None:
    values = VALUE_SETS["gpu"]
    pod = instances(rendered("gpu"))["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == values["instances"]["nodeSelector"]
    assert pod["tolerations"] == values["instances"]["tolerations"]
    assert env(container(pod, "worker"))["KVSTASH_WORKER_DEVICE"] == "cuda"


@pytest.mark.parametrize("value_set", ["defaults", "daemonset", "tls", "pd-disk-pvc-tls-auth"])
def test_probes_check_grpc_health_on_each_port(value_set: str) -> None:
    docs = rendered(value_set)
    seen = set()
    for spec in pod_specs(docs):
        for c in spec["containers"]:
            if c["name"] not in SERVICE_CONTAINERS:
                continue
            seen.add(c["name"])
            (port,) = [p["containerPort"] for p in c["ports"] if p["name"].endswith("grpc")]
            assert env(c)[f"KVSTASH_{c['name'].upper()}_LISTEN"] == f"0.0.0.0:{port}"
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c[kind]
                if VALUE_SETS[value_set].get("tls", {}).get("enabled"):  # kubelet gRPC: no TLS
                    command = probe["exec"]["command"]
                    assert command[:2] == ["kvstash-health", f"127.0.0.1:{port}"]
                    assert "--tls-ca" in command and "--tls-cert" in command
                else:
                    assert probe["grpc"] == {"port": port}, f"{c['name']} {kind}"
    assert seen == set(SERVICE_CONTAINERS)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_pods_are_locked_down(value_set: str) -> None:
    docs = rendered(value_set)
    for spec in pod_specs(docs):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        # Only smg calls the API server (Kubernetes discovery), as its own account.
        discovers = [c["name"] for c in spec["containers"]] == ["gateway"]
        assert spec["automountServiceAccountToken"] is discovers
        assert (spec.get("serviceAccountName") == "rel-kvstash-gateway") is discovers
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
            if c["name"] == "arena-owner":  # chowns the hostPath dir, nothing else
                assert sc["runAsUser"] == 0 and sc["capabilities"]["add"] == ["CHOWN", "FOWNER"]
                continue
            assert sc["runAsNonRoot"] is True and "add" not in sc["capabilities"]
            assert mounts(c)["tmp"] == "/tmp"  # the one writable place besides volumes


def test_services_public_and_headless() -> None:
    docs = rendered("defaults")
    pod = instances(docs)["spec"]["template"]
    by_name = {s["metadata"]["name"]: s["spec"] for s in of_kind(docs, "Service")}
    public, headless = by_name["rel-kvstash"], by_name["rel-kvstash-instances"]
    assert public["type"] == "ClusterIP" and public["ports"][0]["targetPort"] == "grpc"
    assert headless["clusterIP"] == "None"
    for svc in (public, headless):
        assert svc["selector"].items() <= pod["metadata"]["labels"].items()
    grpc_port = container(pod["spec"], "scheduler")["ports"][0]
    assert grpc_port["name"] == "grpc" and headless["ports"][0]["port"] == grpc_port[
        "containerPort"]
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"]["matchLabels"] == headless["selector"]


def test_model_sources_mount_read_only() -> None:
    expected = {"model-pvc": ("persistentVolumeClaim", "/models/Llama-3.2-1B"),
                "model-hostpath": ("hostPath", "/models"),
                "model-image": ("image", "/models")}
    for name, (source, model_flag) in expected.items():
        pod = instances(rendered(name))["spec"]["template"]["spec"]
        worker = container(pod, "worker")
        assert source in volumes(pod)["model"]
        assert env(worker)["KVSTASH_WORKER_MODEL"] == model_flag
        assert next(m for m in worker["volumeMounts"] if m["name"] == "model")["readOnly"]
        assert all("model" not in mounts(c) for c in pod["containers"] if c is not worker)
    pod = instances(rendered("defaults"))["spec"]["template"]["spec"]
    assert env(container(pod, "worker"))["KVSTASH_WORKER_MODEL"] == "tiny"
    assert "model" not in volumes(pod)


def test_tls_and_token_secrets_are_mounted_where_the_flags_point() -> None:
    docs = rendered("tls")
    pod = instances(docs)["spec"]["template"]["spec"]
    assert volumes(pod)["tls"]["secret"]["secretName"] == "kvstash-tls"
    for c in pod["containers"]:
        prefix = f"KVSTASH_{c['name'].upper()}_"
        assert env(c)[prefix + "TLS_CA"] == mounts(c)["tls"] + "/ca.crt"
        assert prefix + "PLAINTEXT" not in env(c)
    scheduler = container(pod, "scheduler")
    assert env(scheduler)["KVSTASH_SCHEDULER_AUTH_TOKEN_FILE"] == mounts(scheduler)["auth"] + (
        "/tokens")
    test_pod = one(docs, "Pod")
    script = test_pod["spec"]["containers"][0]["command"][-1]
    assert "--tls-ca /etc/kvstash/tls/ca.crt" in script and "--token-file" in script


def test_helm_test_pod_checks_health_then_generates() -> None:
    pod = one(rendered("defaults"), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["command"][-1]
    health, generate = script.split("&&")
    assert health.split()[:2] == ["kvstash-health", "rel-kvstash.kv.svc:50051"]
    assert generate.split()[:2] == ["kvstash", "generate"]
    assert "--address rel-kvstash.kv.svc:50051" in generate


def test_notes_render_for_every_value_set(tmp_path: Path) -> None:
    # helm renders NOTES.txt only on install (which wants a cluster): render
    # it from a copy of the chart, as a string in an ordinary template.
    chart = tmp_path / "kvstash"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text(
        '{{- define "notes" -}}\n' + notes + "\n{{- end -}}\n")
    (chart / "templates" / "notes.yaml").write_text(
        'notes: |\n{{ include "notes" . | indent 2 }}\n')
    for name, values in VALUE_SETS.items():
        done = helm("template", "rel", str(chart), "--namespace", "kv",
                    "--show-only", "templates/notes.yaml", values=values, tmp_path=tmp_path)
        assert done.returncode == 0, f"{name}: {done.stderr}"
        text = yaml.safe_load(done.stdout)["notes"]
        assert "helm test rel -n kv" in text, text
        assert ("--tls-ca" in text) is values.get("tls", {}).get("enabled", False), name
        pd = name in PD_VALUE_SETS
        assert ("prefill/decode disaggregation" in text) is pd, name
        netpol = values.get("networkPolicy", {}).get("enabled", False)
        assert ("NetworkPolicies admit, port by port" in text) is netpol, name
        cache = values.get("cache", {})
        mode = cache.get("mode", "sidecar") if cache.get("enabled", True) else None
        persistent = cache.get("disk", {}).get("persistence", {}).get("enabled", False)
        kind = "statefulset" if persistent and mode == "sidecar" else "deployment"
        for pool in ("rel-kvstash-prefill", "rel-kvstash-decode") if pd else ("rel-kvstash",):
            assert f"rollout status {kind}/{pool}\n" in text, f"{name}: {text}"
        cache_kind = {"daemonset": "daemonset", "shared": "statefulset"}.get(str(mode))
        rollouts = [line.strip() for line in text.splitlines() if "rollout status" in line]
        cache_rollouts = [r for r in rollouts if r.endswith("/rel-kvstash-cache")]
        assert cache_rollouts == ([f"kubectl -n kv rollout status {cache_kind}/rel-kvstash-cache"]
                                  if cache_kind else []), name
        assert ("KV cache: shared, one cache service" in text) is (mode == "shared"), name
        assert ("shared-memory arena at" in text) is (mode in ("sidecar", "daemonset") and cache
                                                      .get("arena", {}).get("enabled", True)), name
        monitoring = values.get("metrics", {})
        assert ("ConfigMap rel-kvstash-dashboard" in text) is monitoring.get(
            "grafanaDashboard", {}).get("enabled", False), name
        assert ("PrometheusRule rel-kvstash " in text) is monitoring.get(
            "prometheusRule", {}).get("enabled", False), name
        tokens = "with the first token in\nthe Secret" in text
        assert tokens is (pd and values.get("auth", {}).get("enabled", False)), name
        if pd:
            domain = values.get("clusterDomain", "cluster.local")
            port = values.get("scheduler", {}).get("port", 50051)
            assert f"rel-kvstash-decode.kv.svc.{domain}:{port}" in text, text
        gateway = values.get("gateway", {})
        assert ("port-forward svc/rel-kvstash-gateway" in text) is gateway.get("enabled", False)
        if gateway.get("enabled"):
            port = gateway.get("service", {}).get("port", 8000)
            assert f"curl -s localhost:{port}/v1/completions" in text, text
            assert f"every ready {'prefill' if pd else 'mixed'} scheduler" in text, text
