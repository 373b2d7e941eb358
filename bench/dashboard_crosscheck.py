"""The dashboard's queries on a real Prometheus beside bench.promql, on one
run: a real Prometheus server (`--prometheus`, e.g. Debian's package)
scrapes the pressured P/D stack with smg every second while bench.promql's
scraper does too; then every panel's query is asked of both at the same
instant, and the alert rules are checked by promtool and evaluated by
Prometheus. Prints, per query, the series each gives and how far their
values differ.

Run: python -m bench.dashboard_crosscheck [--prometheus /usr/bin/prometheus]

Not part of `make test`: no Prometheus installs into a virtual environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from bench.dashboard_snapshot import (
    ALL,
    RULES,
    Scraper,
    alert_rules,
    dashboard_queries,
    expand,
    pressure,
    pressured_stack,
    targets,
)
from bench.promql import Series
from kvstash.common.binding import free_port
from kvstash.launch.stack import Stack, running_stack

WINDOW = "10s"  # $__rate_interval: ten scrapes a second apart


def scrape_config(stack: Stack) -> dict[str, object]:
    return {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": f"{labels['pod']}-{labels['job']}",
                 "static_configs": [{"targets": [url.split("/")[2]], "labels": labels}]}
                for url, labels in targets(stack)]}


def ask(base: str, query: str, t: float) -> list[tuple[dict[str, str], float]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query, "time": t})
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.loads(reply.read())
    if body["status"] != "success":
        raise RuntimeError(f"{query}: {body}")
    result = body["data"]["result"]
    if body["data"]["resultType"] == "scalar":
        return [({}, float(result[1]))]
    return [({k: v for k, v in r["metric"].items() if k not in ("instance", "job")},
             float(r["value"][1])) for r in result]


def key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in ("instance", "job")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    promtool = Path(args.prometheus).with_name("promtool")
    subprocess.run([str(promtool), "check", "rules", str(RULES)], check=True)
    series = Series()
    with tempfile.TemporaryDirectory() as tmp, running_stack(pressured_stack()) as stack:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(stack)))
        port = free_port()
        server = subprocess.Popen(
            [args.prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            scraper = Scraper(stack, series, 1.0, [])
            try:
                time.sleep(3)
                asyncio.run(pressure(stack, args.requests, 96))
                now = time.time() - 1.5  # both have scraped up to here
            finally:
                scraper.stop()
            return compare(base, series, now)
        finally:
            server.terminate()
            server.wait()


def compare(base: str, series: Series, now: float) -> int:
    print(f"{'panel query':<58} {'ours':>5} {'prom':>5} {'max rel diff':>12}")
    missing = 0
    for query in dashboard_queries():
        expr = expand(query.expr, {**ALL, "__rate_interval": WINDOW})
        ours = series.query(expr, now)
        ours_by = {key(labels): v for labels, v in ([({}, ours)] if isinstance(ours, float)
                                                    else ours)}
        theirs = {key(labels): v for labels, v in ask(base, expr, now)}
        diffs = [abs(ours_by[k] - v) / max(abs(v), 1e-9) for k, v in theirs.items()
                 if k in ours_by and math.isfinite(v) and math.isfinite(ours_by[k])]
        missing += not theirs or set(theirs) != set(ours_by)
        name = f"{query.panel[:38]} / {query.legend[:16]}"
        print(f"{name:<58} {len(ours_by):>5} {len(theirs):>5} "
              f"{max(diffs) if diffs else math.nan:>12.2f}")
    for alert, expr in alert_rules().items():
        print(f"rule {alert}: Prometheus evaluates it, {len(ask(base, expr, now))} firing")
    print(f"queries whose series differ or that Prometheus answers empty: {missing}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
