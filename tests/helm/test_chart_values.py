"""helm/kvstash refuses bad values: values.schema.json for wrong types and
unknown keys, templates/_validate.tpl for inconsistent combinations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, env, helm, render, render_error

SCHEMA_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"colour": "blue"}, "Additional property colour is not allowed"),
    ({"cache": {"arena": {"sizeLimt": "2Gi"}}}, "Additional property sizeLimt is not allowed"),
    ({"worker": {"gpu": {"count": "one"}}}, "worker.gpu.count: Invalid type. Expected: integer"),
    ({"instances": {"replicas": 1.5}}, "instances.replicas: Invalid type. Expected: integer"),
    ({"cache": {"memoryBudget": "8GB"}}, "cache.memoryBudget: Does not match pattern"),
    ({"cache": {"prefixTier": {"memoryShare": 0}}}, "cache.prefixTier.memoryShare"),
    ({"cache": {"prefixTier": {"segmentTokens": -16}}}, "cache.prefixTier.segmentTokens"),
    ({"cache": {"prefixTier": {"write": "around"}}}, "cache.prefixTier.write"),
    ({"cache": {"mode": "per-node"}}, "cache.mode: cache.mode must be one of the following"),
    ({"cache": {"daemonset": {"hostPath": "dev/shm/kv"}}},
     "cache.daemonset.hostPath: Does not match pattern"),
    ({"worker": {"gpu": {"count": -1}}}, "worker.gpu.count: Must be greater than or equal to 0"),
    ({"instances": {"role": "decode"}}, "instances.role: instances.role must be one of"),
    ({"scheduler": {"flags": {"--max-num-seqs": 8}}}, "Does not match pattern"),
    # P/D pools: each P/D flag belongs to its own role's pool.
    ({"instances": {"role": "prefill"}}, "instances.role: instances.role must be one of"),
    ({"instances": {"prefill": {"reservationTimeout": 30}}},
     "instances.prefill: Additional property reservationTimeout is not allowed"),
    ({"instances": {"decode": {"handoffWait": 5}}},
     "instances.decode: Additional property handoffWait is not allowed"),
    ({"instances": {"decode": {"replica": 2}}},
     "instances.decode: Additional property replica is not allowed"),
    ({"instances": {"prefill": {"workerResources": {"request": {"cpu": "2"}}}}},
     "instances.prefill.workerResources: Additional property request is not allowed"),
    ({"instances": {"prefill": {"handoffWait": "10s"}}},
     "instances.prefill.handoffWait: Invalid type. Expected: number"),
    ({"instances": {"decode": {"replicas": "2"}}},
     "instances.decode.replicas: Invalid type. Expected: integer"),
    ({"instances": {"decode": {"reservationTimeout": 0}}},
     "instances.decode.reservationTimeout: Must be greater than or equal to 0.001"),
    ({"instances": {"decode": {"gpuCount": -1}}},
     "instances.decode.gpuCount: Must be greater than or equal to 0"),
    ({"instances": {"prefill": {"nodeSelector": {"gpu-count": 8}}}},
     "instances.prefill.nodeSelector.gpu-count: Invalid type. Expected: string"),
    ({"clusterDomain": "Cluster_Local"}, "clusterDomain: Does not match pattern"),
    # The shared cache's own settings.
    ({"cache": {"shared": {"replicas": 2}}},
     "cache.shared: Additional property replicas is not allowed"),
    ({"cache": {"shared": {"nodeSelector": {"zone": 1}}}},
     "cache.shared.nodeSelector.zone: Invalid type. Expected: string"),
    # The gateway: smg's --policy choices, and no key the chart does not know.
    ({"gateway": {"policy": "least_busy"}},
     "gateway.policy: gateway.policy must be one of the following"),
    ({"gateway": {"workerUrls": ["grpc://a:50051"]}},
     "gateway: Additional property workerUrls is not allowed"),
    ({"gateway": {"cacheAware": {"threshold": 0.5}}},
     "gateway.cacheAware: Additional property threshold is not allowed"),
    ({"gateway": {"cacheAware": {"cacheThreshold": 1.5}}},
     "gateway.cacheAware.cacheThreshold: Must be less than or equal to 1"),
    ({"gateway": {"logLevel": "trace"}}, "gateway.logLevel: gateway.logLevel must be one of"),
    ({"gateway": {"replicas": "2"}}, "gateway.replicas: Invalid type. Expected: integer"),
    ({"gateway": {"service": {"type": "ExternalName"}}},
     "gateway.service.type: gateway.service.type must be one of"),
    ({"gateway": {"flags": {"--max-concurrent-requests": 8}}}, "Does not match pattern"),
    ({"images": {"gateway": {"repo": "smg"}}},
     "images.gateway: Additional property repo is not allowed"),
    # NetworkPolicies: known keys only, and peers Kubernetes would take.
    ({"networkPolicy": {"enable": True}},
     "networkPolicy: Additional property enable is not allowed"),
    ({"networkPolicy": {"clients": [{"podSelektor": {"matchLabels": {"app": "x"}}}]}},
     "networkPolicy.clients.0: Additional property podSelektor is not allowed"),
    ({"networkPolicy": {"gatewayClients": [{"ipBlock": {"cidr": "10.0.0.0/8", "exept": []}}]}},
     "networkPolicy.gatewayClients.0.ipBlock: Additional property exept is not allowed"),
    ({"networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabel": {"a": "b"}}}]}},
     "networkPolicy.metricsFrom.0.namespaceSelector: Additional property matchLabel is not "
     "allowed"),
    ({"networkPolicy": {"metricsFrom": [{}]}},
     "networkPolicy.metricsFrom.0: Must have at least 1 properties"),
    ({"networkPolicy": {"clients": {"podSelector": {}}}},
     "networkPolicy.clients: Invalid type. Expected: array"),
    # Compared with the memory limit, so in the limit's units.
    ({"cache": {"resources": {"requests": {"memory": "4G"}}}},
     "cache.resources.requests.memory: Does not match pattern"),
]


@pytest.mark.parametrize(("values", "message"), SCHEMA_REFUSALS)
def test_schema_refuses(values: dict[str, Any], message: str, tmp_path: Path) -> None:
    error = render_error(values, tmp_path)
    assert "values don't meet the specifications of the schema" in error
    assert message in error


VALIDATION_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"cache": {"memoryBudget": "4Gi", "resources": {"limits": {"memory": "4Gi"}}}},
     "cache.memoryBudget (4096Mi) + cache.overhead (544Mi) = 4640Mi exceeds "
     "cache.resources.limits.memory (4096Mi)"),
    ({"cache": {"memoryBudget": "2Gi", "arena": {"sizeLimit": "1Gi"}}},
     "cache.memoryBudget (2048Mi) exceeds cache.arena.sizeLimit (1024Mi)"),
    ({"instances": {"replicas": 0, "pdb": {"minAvailable": 1, "maxUnavailable": None}}},
     "instances.pdb.minAvailable is 1 but instances.replicas is 0"),
    ({"instances": {"pdb": {"minAvailable": 1}}},
     "instances.pdb: set exactly one of minAvailable and maxUnavailable"),
    ({"cache": {"disk": {"enabled": True, "budget": "20Gi",
                         "persistence": {"enabled": True, "size": "10Gi"}}}},
     "cache.disk.budget (20480Mi) exceeds the room for the disk tier (10240Mi, "
     "cache.disk.persistence.size)"),
    ({"cache": {"mode": "daemonset", "disk": {"enabled": True, "persistence": {"enabled": True}}}},
     "cache.disk.persistence needs cache.mode sidecar (each instance's cache gets its own "
     "claim) or shared"),
    # The shared cache's budget is checked against its limit like any other's.
    ({"cache": {"mode": "shared", "memoryBudget": "8Gi", "overhead": "1Gi",
                "resources": {"limits": {"memory": "8Gi"}}}},
     "cache.memoryBudget (8192Mi) + cache.overhead (1024Mi) = 9216Mi exceeds "
     "cache.resources.limits.memory (8192Mi)"),
    ({"worker": {"gpu": {"count": 1}, "device": "cpu"}},
     "worker.gpu.count is 1 but worker.device is cpu"),
    ({"model": {"source": "pvc"}}, "model.source is pvc: set model.pvc.claimName"),
    ({"model": {"source": "image"}}, "model.source is image: set model.image.reference"),
    ({"tls": {"enabled": True}}, "tls.enabled: set tls.secretName"),
    ({"auth": {"enabled": True}}, "auth.enabled: set auth.secretName"),
    ({"tracing": {"enabled": True}}, "tracing.enabled: set tracing.endpoint"),
    # The SDK traces every request instead, with a warning in each log.
    *[({"tracing": {"enabled": True, "endpoint": "http://otel:4317", "samplerArg": arg}},
       f'tracing.samplerArg "{arg}" is no ratio from 0 to 1') for arg in ("10%", "2", "0,1")],
    ({"metrics": {"serviceMonitor": {"enabled": True}}},
     "metrics.serviceMonitor.enabled needs metrics.enabled"),
    # The Prometheus Operator drops such a ServiceMonitor: nothing is scraped.
    ({"metrics": {"enabled": True, "serviceMonitor": {"enabled": True, "interval": "5s"}}},
     "metrics.serviceMonitor.scrapeTimeout 10s is longer than metrics.serviceMonitor.interval "
     "5s"),
    ({"metrics": {"enabled": True, "serviceMonitor": {"enabled": True, "interval": "1m",
                                                       "scrapeTimeout": "90000ms"}}},
     "metrics.serviceMonitor.scrapeTimeout 90000ms is longer than"),
    ({"metrics": {"grafanaDashboard": {"enabled": True}}},
     "metrics.grafanaDashboard.enabled needs metrics.enabled"),
    ({"metrics": {"prometheusRule": {"enabled": True}}},
     "metrics.prometheusRule.enabled needs metrics.enabled"),
    ({"cache": {"flags": {"memory-budget": "8GiB"}}},
     "cache.flags.memory-budget is set by the chart"),
    ({"worker": {"flags": {"listen": "0.0.0.0:1"}}}, "worker.flags.listen is set by the chart"),
    # P/D pools.
    ({"instances": {"role": "pd", "decode": {"replicas": 0}}, "cache": {"mode": "shared"}},
     "instances.role is pd but instances.decode.replicas is 0: prefill instances hand every "
     "request to the decode pool, so it needs at least 1"),
    ({"instances": {"role": "pd", "prefill": {"replicas": 0}}, "cache": {"mode": "shared"}},
     "instances.role is pd but instances.prefill.replicas is 0: clients call the prefill pool"),
    # The KV handoff needs one cache both pools reach.
    ({"instances": {"role": "pd"}},
     "instances.role is pd but cache.mode is sidecar: the KV handoff goes through one cache "
     "service both pools reach"),
    ({"instances": {"role": "pd"}, "cache": {"mode": "daemonset"}},
     "a per-node cache is not shared across pods (decode instances would miss every snapshot "
     "and recompute the prompt); set cache.mode shared"),
    ({"instances": {"role": "pd"}, "cache": {"enabled": False, "mode": "shared"}},
     "instances.role is pd but cache.enabled is false: the KV handoff goes through one cache "
     "service both pools reach"),
    ({"instances": {"role": "pd", "prefill": {"replicas": 3}, "decode": {"replicas": 1},
                    "pdb": {"minAvailable": 2, "maxUnavailable": None}},
      "cache": {"mode": "shared"}},
     "instances.pdb.minAvailable is 2 but instances.decode.replicas is 1"),
    ({"instances": {"role": "pd", "decode": {"gpuCount": 1}}, "worker": {"device": "cpu"},
      "cache": {"mode": "shared"}},
     "instances.decode.gpuCount is 1 but worker.device is cpu"),
    ({"scheduler": {"flags": {"role": "decode"}}}, "scheduler.flags.role is set by the chart"),
    ({"scheduler": {"flags": {"decode-address": "decode:50051"}}},
     "scheduler.flags.decode-address is set by the chart"),
    ({"scheduler": {"flags": {"handoff-wait": 3}}},
     "scheduler.flags.handoff-wait is set by the chart"),
    ({"scheduler": {"flags": {"token-file": "/tmp/token"}}},
     "scheduler.flags.token-file is set by the chart"),
    # The gateway: something to route to, over channels smg can speak.
    ({"gateway": {"enabled": True}, "instances": {"replicas": 0}},
     "gateway.enabled but instances.replicas is 0: the gateway would have no scheduler to "
     "route requests to"),
    ({"gateway": {"enabled": True}, "cache": {"mode": "shared"},
      "instances": {"role": "pd", "prefill": {"replicas": 0}}},
     "gateway.enabled but instances.prefill.replicas is 0: the gateway would have no scheduler "
     "to route requests to (it routes to the prefill pool only"),
    ({"gateway": {"enabled": True}, "tls": {"enabled": True, "secretName": "kvstash-tls"}},
     "gateway.enabled with tls.enabled: the schedulers then accept only TLS, and smg 1.13.0 "
     "speaks plaintext gRPC to its workers"),
    ({"gateway": {"enabled": True}, "auth": {"enabled": True, "secretName": "kvstash-tokens"}},
     "gateway.enabled with auth.enabled: the schedulers then demand a bearer token "
     "(auth.secretName \"kvstash-tokens\") on every VllmEngine call, and smg 1.13.0 sends gRPC "
     "workers none"),
    ({"gateway": {"enabled": True, "pdb": {"minAvailable": 1}}},
     "gateway.pdb: set exactly one of minAvailable and maxUnavailable"),
    ({"gateway": {"enabled": True, "replicas": 2,
                  "pdb": {"minAvailable": 3, "maxUnavailable": None}}},
     "gateway.pdb.minAvailable is 3 but gateway.replicas is 2"),
    ({"gateway": {"flags": {"service-discovery-port": 50052}}},
     "gateway.flags.service-discovery-port is set by the chart"),
    ({"gateway": {"flags": {"worker-urls": "grpc://a:50051"}}},
     "gateway.flags.worker-urls is set by the chart"),
    ({"gateway": {"flags": {"spill-abs-threshold": 8}}},
     "gateway.flags.spill-abs-threshold is set by the chart"),
    ({"networkPolicy": {"enabled": True, "clients": [
        {"podSelector": {}}, {"ipBlock": {"cidr": "10.0.0.0/8"}, "namespaceSelector": {}}]}},
     "networkPolicy.clients[1] has an ipBlock beside a podSelector or namespaceSelector"),
    # Disruption budgets that would block every eviction (drains wait forever).
    ({"instances": {"replicas": 2, "pdb": {"minAvailable": 2, "maxUnavailable": None}}},
     "instances.pdb.minAvailable is 2 but instances.replicas is 2: no pod could ever be "
     "evicted, so node drains would wait forever"),
    ({"instances": {"pdb": {"maxUnavailable": 0}}},
     "instances.pdb.maxUnavailable is 0: no pod could ever be evicted"),
    ({"instances": {"role": "pd", "prefill": {"replicas": 2}, "decode": {"replicas": 1},
                    "pdb": {"minAvailable": 1, "maxUnavailable": None}},
      "cache": {"mode": "shared"}},
     "instances.pdb.minAvailable is 1 but instances.decode.replicas is 1: no pod could ever "
     "be evicted"),
    ({"gateway": {"enabled": True, "replicas": 2,
                  "pdb": {"minAvailable": 2, "maxUnavailable": None}}},
     "gateway.pdb.minAvailable is 2 but gateway.replicas is 2: no gateway pod could ever be "
     "evicted"),
    ({"gateway": {"enabled": True, "replicas": 2, "pdb": {"maxUnavailable": 0}}},
     "gateway.pdb.maxUnavailable is 0: no gateway pod could ever be evicted"),
    # The worker has one built-in model.
    ({"model": {"name": "llama-3.1-8b"}},
     'model.name is "llama-3.1-8b" with model.source builtin: the worker has one built-in '
     'model, "tiny"; serve a checkpoint with model.source pvc, hostPath or image'),
    # A memory request above the cache's limit (Kubernetes refuses the pod).
    ({"cache": {"resources": {"requests": {"memory": "4Gi"}}}},
     "cache.resources.requests.memory (4096Mi) exceeds the cache's memory limit (1568Mi, "
     "derived from cache.memoryBudget + cache.overhead)"),
    ({"cache": {"mode": "shared", "resources": {"requests": {"memory": "2Gi"},
                                                "limits": {"memory": "1600Mi"}}}},
     "cache.resources.requests.memory (2048Mi) exceeds the cache's memory limit (1600Mi, "
     "cache.resources.limits.memory)"),
    # Prefix segments of whole KV blocks (the scheduler refuses others once
    # its worker has loaded).
    ({"cache": {"prefixTier": {"segmentTokens": 100}}},
     "cache.prefixTier.segmentTokens is 100, not a multiple of the worker's KV block size 16 "
     "(the worker's default; worker.flags.block-size sets it): every scheduler would refuse "
     "it at start, once its worker had loaded the model; use e.g. 96 or 112"),
    ({"worker": {"flags": {"block-size": 32}}, "cache": {"prefixTier": {"segmentTokens": 16}}},
     "cache.prefixTier.segmentTokens is 16, not a multiple of the worker's KV block size 32 "
     "(worker.flags.block-size)"),
    ({"worker": {"flags": {"block-size": 0}}},
     "worker.flags.block-size is 0: the worker takes 1 to 1024 tokens per KV block"),
    # The scheduler's startup probe outlasts its wait for the worker.
    ({"worker": {"probes": {"startup": {"periodSeconds": 10, "failureThreshold": 120,
                                        "timeoutSeconds": 5}}}},
     "scheduler.probes.startup allows the scheduler 600 s (120 x 5 s) but it waits up to "
     "1200 s for its worker (--worker-wait, from worker.probes.startup: 120 x 10 s"),
    ({"scheduler": {"flags": {"worker-wait": 900.5}}},
     "but it waits up to 900.5 s for its worker (--worker-wait, from "
     "scheduler.flags.worker-wait), answering NOT_SERVING until then: the kubelet would "
     "restart it while the worker still loads; raise scheduler.probes.startup.failureThreshold "
     "to at least 181"),
    # A flag the chart sets, spelled negated, is the chart's too; any other
    # negated spelling would be ignored by the service (no flag is no-...).
    ({"worker": {"flags": {"no-cache-arena": True}}},
     "worker.flags.no-cache-arena negates --cache-arena, which is set by the chart"),
    ({"scheduler": {"flags": {"no-plaintext": True}}},
     "scheduler.flags.no-plaintext negates --plaintext, which is set by the chart"),
    ({"worker": {"flags": {"no-batch-invariant": True}}},
     "worker.flags.no-batch-invariant: write batch-invariant: false (a switch is passed by its "
     "own name; the service would ignore KVSTASH_WORKER_NO_BATCH_INVARIANT)"),
    ({"gateway": {"flags": {"no-port": True}}},
     "gateway.flags.no-port negates --port, which is set by the chart"),
    # One port twice in a pod: Kubernetes takes it, and the second to listen
    # there crash-loops on "address in use".
    ({"metrics": {"enabled": True, "ports": {"scheduler": 50051}}},
     "scheduler.port and metrics.ports.scheduler are both 50051, one port twice in an instance "
     "pod (its scheduler, worker and, in cache.mode sidecar, cache share one network): "
     "Kubernetes takes such a pod, and the second to listen there crash-loops on \"address in "
     "use\"; give each its own port"),
    ({"worker": {"port": 50051}}, "scheduler.port and worker.port are both 50051"),
    ({"cache": {"port": 50061}}, "worker.port and cache.port are both 50061"),
    ({"metrics": {"enabled": True, "ports": {"worker": 9403}}},
     "metrics.ports.worker and metrics.ports.cache are both 9403"),
    ({"cache": {"mode": "shared"}, "metrics": {"enabled": True, "ports": {"cache": 50071}}},
     "cache.port and metrics.ports.cache are both 50071, one port twice in the cache's pod"),
    # smg serves its metrics port with metrics off too (on 127.0.0.1).
    ({"gateway": {"enabled": True, "port": 9404}},
     "gateway.port and metrics.ports.gateway are both 9404, one port twice in the gateway's pod"),
]


@pytest.mark.parametrize(("values", "message"), VALIDATION_REFUSALS)
def test_validation_refuses(values: dict[str, Any], message: str, tmp_path: Path) -> None:
    error = render_error(values, tmp_path)
    assert "kvstash: inconsistent values:" in error
    assert message in error


def test_validation_names_every_problem_at_once(tmp_path: Path) -> None:
    error = render_error({"tls": {"enabled": True}, "auth": {"enabled": True}}, tmp_path)
    assert "tls.secretName" in error and "auth.secretName" in error


@pytest.mark.parametrize("values", [
    {"metrics": {"ports": {"scheduler": 50051, "worker": 50061}}},
    {"cache": {"mode": "shared", "port": 50061}},
    {"cache": {"enabled": False, "port": 50051}},
], ids=["metrics-off", "cache-in-its-own-pod", "no-cache"])
def test_one_port_in_two_pods_renders(values: dict[str, Any], tmp_path: Path) -> None:
    # Ports of containers that never share a pod, or that do not listen.
    assert render(values, tmp_path)


def test_pd_keys_wait_for_role_pd(tmp_path: Path) -> None:
    # Pool settings, even ones role pd would refuse, render nothing in role mixed.
    docs = render({"instances": {"decode": {"replicas": 0, "gpuCount": 4}}}, tmp_path)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    assert [d["metadata"]["name"] for d in workloads] == ["rel-kvstash"]
    assert not any("decode" in d["metadata"]["name"] for d in docs)


def test_gateway_refusals_name_every_problem_at_once(tmp_path: Path) -> None:
    error = render_error({"gateway": {"enabled": True}, "instances": {"replicas": 0},
                          "tls": {"enabled": True, "secretName": "t"},
                          "auth": {"enabled": True, "secretName": "a"}}, tmp_path)
    for problem in ("but instances.replicas is 0", "with tls.enabled", "with auth.enabled"):
        assert f"gateway.enabled {problem}" in error, problem


def test_whole_numbers_pass_without_an_exponent(tmp_path: Path) -> None:
    # YAML numbers reach templates as floats: 1000000 would print as 1e+06.
    docs = render({"worker": {"flags": {"num-blocks": 1000000}}}, tmp_path)
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    worker = next(c for c in pod["containers"] if c["name"] == "worker")
    variables = {e["name"]: e.get("value") for e in worker["env"]}
    assert variables["KVSTASH_WORKER_NUM_BLOCKS"] == "1000000"


def test_memory_limit_is_derived_from_the_budget(tmp_path: Path) -> None:
    docs = render({"cache": {"memoryBudget": "6Gi", "overhead": "768Mi"}}, tmp_path)
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    cache = next(c for c in pod["containers"] if c["name"] == "cache")
    assert cache["resources"]["limits"]["memory"] == f"{6 * 1024 + 768}Mi"
    assert cache["resources"]["requests"]["memory"] == f"{6 * 1024 + 768}Mi"
    arena = next(v for v in pod["volumes"] if v["name"] == "arena")
    assert arena["emptyDir"]["sizeLimit"] == f"{6 * 1024 + 64}Mi"


@pytest.mark.parametrize(("tier", "tokens", "write", "share"), [
    ({}, "256", "through", "0.5"),
    ({"segmentTokens": 0, "write": "back", "memoryShare": 0.25}, "0", "back", "0.25"),
])
def test_the_prefix_tier_reaches_the_scheduler_and_the_cache(
        tier: dict[str, Any], tokens: str, write: str, share: str, tmp_path: Path) -> None:
    docs = render({"cache": {"prefixTier": tier}} if tier else {}, tmp_path)
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    containers = {c["name"]: env(c) for c in pod["containers"]}
    assert containers["scheduler"]["KVSTASH_SCHEDULER_PREFIX_SEGMENT_TOKENS"] == tokens
    assert containers["scheduler"]["KVSTASH_SCHEDULER_PREFIX_WRITE"] == write
    assert containers["cache"]["KVSTASH_CACHE_UNPINNED_SHARE"] == share


def _names(release: str, kind: str, tmp_path: Path,
           values: dict[str, Any] | None = None) -> list[str] | str:
    """The names of the `kind` objects `helm template` renders for `release`
    (by default a cache per node and the gateway: no StatefulSet, whose
    names must be shorter), or helm's error."""
    values = values or {"cache": {"mode": "daemonset"}, "gateway": {"enabled": True}}
    done = helm("template", release, str(CHART), "--namespace", "kv", values=values,
                tmp_path=tmp_path)
    if done.returncode != 0:
        return done.stderr
    return [d["metadata"]["name"] for d in yaml.safe_load_all(done.stdout)
            if d and d["kind"] == kind]


def _service_names(release: str, tmp_path: Path) -> list[str] | str:
    return _names(release, "Service", tmp_path)


PERSISTENT_SIDECAR = {"cache": {"mode": "sidecar",
                                "disk": {"enabled": True, "persistence": {"enabled": True}}}}


@pytest.mark.parametrize(("values", "longest_release", "longest"), [
    ({"cache": {"mode": "shared"}}, 38, "-kvstash-cache"),
    (PERSISTENT_SIDECAR, 44, "-kvstash"),
])
def test_statefulset_names_fit_their_pods_labels_or_the_render_says_why(
        values: dict[str, Any], longest_release: int, longest: str, tmp_path: Path) -> None:
    """A StatefulSet's pods carry the label controller-revision-hash, its name
    and 11 characters: a name past 52 renders, installs, and no pod starts."""
    names = _names("r" * longest_release, "StatefulSet", tmp_path, values)
    assert isinstance(names, list) and max(map(len, names)) == 52, names
    assert "r" * longest_release + longest in names
    error = _names("r" * (longest_release + 1), "StatefulSet", tmp_path, values)
    assert isinstance(error, str)
    assert (f'the StatefulSet "{"r" * (longest_release + 1)}{longest}" is 53 characters: '
            "Kubernetes would refuse its pods") in error
    assert "a fullnameOverride 1 characters shorter" in error


def test_service_names_fit_kubernetes_or_the_render_says_why(tmp_path: Path) -> None:
    """A Service name is a DNS label (63 characters): a long release name
    rendered "<release>-kvstash-instances" past it, which Kubernetes refuses
    at install, after helm said nothing."""
    names = _service_names("r" * 45, tmp_path)  # <release>-kvstash: 53 characters
    assert isinstance(names, list) and max(len(n) for n in names) == 63, names
    error = _service_names("r" * 46, tmp_path)
    assert isinstance(error, str)
    assert (f'the release\'s full name "{"r" * 46}-kvstash" is 54 characters: Kubernetes would '
            f"refuse the Service {'r' * 46}-kvstash-instances") in error
