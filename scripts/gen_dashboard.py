"""Generates the Grafana dashboard, helm/kvstash/files/grafana-dashboard.json (the
chart ships it as a ConfigMap; it also imports as it is).

Every query reads series the services export (tests/integration/
test_dashboard.py checks each one against a real stack's scrape), selected
by two variables: `pool` (the pod label kvstash.io/role the chart's
ServiceMonitor copies onto every instance series: mixed, prefill, decode)
and `pod`. The cache and gateway rows are not narrowed by them.

`--check` fails when the committed file differs from what this writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "helm/kvstash/files/grafana-dashboard.json"
SEL = 'kvstash_io_role=~"$pool",pod=~"$pod"'
RATE = "$__rate_interval"


def rate(metric: str, by: str = "", labels: str = SEL) -> str:
    """Per-second rate of a counter, summed (by `by`)."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{labels}}}[{RATE}]))"


def quantiles(histogram: str, labels: str = SEL) -> list[tuple[str, str]]:
    """p50, p90 and p99 of a histogram over the selected series."""
    return [(f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{{{labels}}}"
             f"[{RATE}])))", f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]


def gauge(metric: str, how: str = "sum", labels: str = SEL) -> str:
    return f"{how} ({metric}{{{labels}}})"


class Board:
    """Panels laid out two to a row of the grid, under collapsible rows."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.column = 0

    def row(self, title: str) -> None:
        self.y += 8 if self.column else 0
        self.column = 0
        self.panels.append({"type": "row", "title": title, "collapsed": False,
                            "id": len(self.panels) + 1, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def panel(self, title: str, unit: str, queries: list[tuple[str, str]],
              description: str = "") -> None:
        self.panels.append({
            "type": "timeseries", "title": title, "description": description,
            "id": len(self.panels) + 1,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * self.column, "y": self.y},
            "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}},
            "targets": [{"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i),
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for i, (expr, legend) in enumerate(queries)],
        })
        self.column ^= 1
        self.y += 0 if self.column else 8


def panels() -> list[dict[str, Any]]:
    s = "kvstash_scheduler_"
    b = Board()
    b.row("Traffic")
    b.panel("Requests finished by reason", "reqps",
            [(rate(s + "finished_requests_by_reason_total", "reason"), "{{reason}}")])
    b.panel("Tokens", "short", [
        (rate(s + "prompt_tokens_total"), "prompt tokens/s"),
        (rate(s + "generation_tokens_total"), "generated tokens/s"),
        (rate(s + "prefix_hit_tokens_total"), "prefix-cache hit tokens/s")])
    b.panel("Requests in the scheduler", "short", [
        (gauge(s + "num_waiting"), "waiting"), (gauge(s + "num_running_prefill"), "prefilling"),
        (gauge(s + "num_running_decode"), "decoding"), (gauge(s + "num_offloaded"), "offloaded")])
    b.row("Latency")
    b.panel("Time to first token", "s", quantiles(s + "ttft_seconds"))
    b.panel("Time per output token", "s", quantiles(s + "time_per_output_token_seconds"))
    b.panel("End-to-end latency", "s", quantiles(s + "e2e_request_latency_seconds"))
    b.panel("Queue time", "s", quantiles(s + "queue_time_seconds"))
    b.row("KV memory")
    b.panel("KV pool usage", "percentunit",
            [(gauge(s + "kv_usage_ratio", "max by (pod)"), "{{pod}}")])
    b.panel("KV blocks", "short", [
        (gauge(s + "num_total_blocks"), "total"), (gauge(s + "num_free_blocks"), "free"),
        (gauge(s + "num_evictable_blocks"), "evictable (prefix cache)")])
    b.panel("new_token_ratio (output blocks reserved per request)", "percentunit",
            [(gauge(s + "new_token_ratio", "max by (pod)"), "{{pod}}")])
    b.row("Preemption")
    b.panel("Preemptions by mode and reason", "ops",
            [(rate(s + "preemptions_total", "mode, reason"), "{{mode}} ({{reason}})")])
    b.panel("Tokens recomputed", "short", [(rate(s + "recomputed_tokens_total"), "tokens/s")],
            "Prefill spent again on preempted requests: 0 where offload succeeds.")
    b.panel("KV offloaded and restored", "Bps", [
        (rate(s + "offloaded_bytes_total"), "offloaded"),
        (rate(s + "restored_bytes_total"), "restored")])
    b.panel("Offload and restore duration", "s", [
        *[(e, "offload " + q) for e, q in quantiles(s + "offload_seconds")[::2]],
        *[(e, "restore " + q) for e, q in quantiles(s + "restore_seconds")[::2]]])
    b.panel("Offload and restore failures", "ops", [
        (rate(s + "offload_failures_total"), "offload"),
        (rate(s + "restore_failures_total"), "restore")])
    b.row("Cache service")
    c = "kvstash_cache_"
    b.panel("Bytes per tier", "bytes", [
        (gauge(c + "memory_bytes", labels=""), "memory"),
        (gauge(c + "memory_budget_bytes", labels=""), "memory budget"),
        (gauge(c + "disk_bytes", labels=""), "disk"),
        (gauge(c + "disk_budget_bytes", labels=""), "disk budget")])
    b.panel("Snapshots per tier", "short", [
        (gauge(c + "memory_snapshots", labels=""), "memory"),
        (gauge(c + "disk_snapshots", labels=""), "disk")])
    b.panel("Refusals, evictions, spills", "ops", [
        (rate(c + "refused_puts_total", labels=""), "puts refused"),
        (rate(c + "failed_puts_total", labels=""), "puts failed"),
        (rate(c + "evictions_total", labels=""), "evictions"),
        (rate(c + "spills_total", labels=""), "spills to disk")])
    b.panel("Bytes in and out", "Bps", [
        (rate(c + "bytes_in_total", labels=""), "in"),
        (rate(c + "bytes_out_total", labels=""), "out")])
    b.row("Prefix tier")
    b.panel("Prompt tokens loaded from the tier", "short",
            [(rate(s + "prefix_tier_hit_tokens_total"), "tokens/s")],
            "Prompt segments read from the cache tier instead of prefilled.")
    b.panel("Tier bytes", "Bps", [(rate(s + "prefix_tier_loaded_bytes_total"), "loaded"),
                                  (rate(s + "prefix_tier_saved_bytes_total"), "saved")])
    b.panel("Tier lookups, loads and saves", "ops", [
        (rate(s + "prefix_tier_lookups_total", "result"), "lookups ({{result}})"),
        (rate(s + "prefix_tier_loads_declined_total"), "loads declined (prefill cheaper)"),
        (rate(s + "prefix_tier_load_failures_total"), "load failures"),
        (rate(s + "prefix_tier_saves_total"), "saves"),
        (rate(s + "prefix_tier_save_failures_total"), "save failures")])
    b.panel("Tier load time", "s", quantiles(s + "prefix_tier_load_seconds"))
    b.row("Prefill/decode")
    b.panel("Decode reservations", "ops", [
        (rate(s + "reservations_accepted_total"), "accepted"),
        (rate(s + "reservations_refused_total"), "refused"),
        (rate(s + "reservations_expired_total"), "expired"),
        (gauge(s + "num_reserved"), "held now")])
    b.panel("Hand-offs", "ops", [
        (rate(s + "handoffs_total"), "handed off"),
        (rate(s + "handoff_failures_total"), "failed")])
    b.panel("Hand-off time", "s", quantiles(s + "handoff_seconds"))
    b.panel("Hand-off bytes", "Bps", [
        (rate(s + "handoff_bytes_total"), "copied out (prefill)"),
        (rate(s + "handoff_restored_bytes_total"), "restored (decode)")])
    b.row("Worker")
    w = "kvstash_worker_"
    b.panel("Step time", "s", quantiles(w + "step_seconds"))
    b.panel("Tokens computed", "short", [
        (rate(w + "prefill_tokens_total"), "prefill tokens/s"),
        (rate(w + "decode_tokens_total"), "decode tokens/s")])
    b.row("Gateway (smg)")
    b.panel("HTTP responses by status", "reqps", [
        (rate("smg_http_responses_total", "status_code", 'path=~"/v1/.*"'), "{{status_code}}")])
    b.panel("smg time to first token and per output token", "s", [
        *[(e, "TTFT " + q) for e, q in quantiles("smg_router_ttft_seconds", "")[::2]],
        *[(e, "TPOT " + q) for e, q in quantiles("smg_router_tpot_seconds", "")[::2]]])
    b.panel("Requests in flight per engine", "short",
            [("sum by (worker) (smg_worker_requests_active)", "{{worker}}")])
    return b.panels


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query,
            "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2,
            "current": {"text": "All", "value": "$__all"}}


def dashboard() -> dict[str, Any]:
    waiting = "kvstash_scheduler_num_waiting"
    return {
        "title": "kvstash", "uid": "kvstash", "editable": True, "schemaVersion": 39,
        "tags": ["kvstash", "llm-serving"], "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s", "graphTooltip": 1,
        "description": "KV-cache-aware LLM serving: traffic, latency, KV memory, "
                       "preemption, the cache service, the prefix tier, P/D, the worker "
                       "and smg.",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}},
            variable("pool", "pool", f"label_values({waiting}, kvstash_io_role)"),
            variable("pod", "instance",
                     f'label_values({waiting}{{kvstash_io_role=~"$pool"}}, pod)'),
        ]},
        "panels": panels(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="fail if the committed dashboard differs from what this writes")
    args = parser.parse_args()
    text = json.dumps(dashboard(), indent=1) + "\n"
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python scripts/gen_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
