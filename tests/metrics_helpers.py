"""Reading a service's Prometheus endpoint in tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """Sample name -> value, labels appended as {k=v,...}; histogram buckets left out."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" in s.labels:
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples
