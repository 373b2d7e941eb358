"""kvstash.common.stats and the collector that exports them: a figure declared once,
as a field, is what the snapshot copies and what /metrics shows."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstash.common.metrics import StatsCollector
from kvstash.common.stats import Kind, Stat, counter, declared, gauge, values


@dataclass(slots=True)
class Counters:
    num_puts: int = counter("puts", "Completed puts")
    bytes_in: int = counter("bytes_in", "Bytes received")


@dataclass(slots=True, kw_only=True)
class Stats(Counters):
    num_spills: int = counter("spills", "Spills")
    used_bytes: int = gauge("Bytes held")
    ratio: float = gauge("A share", exported=False)
    up: bool = gauge("1 while up")


def test_declared_lists_each_field_once_base_class_first() -> None:
    assert declared(Stats) == (
        Stat("num_puts", Kind.COUNTER, "Completed puts", "puts", int),
        Stat("bytes_in", Kind.COUNTER, "Bytes received", "bytes_in", int),
        Stat("num_spills", Kind.COUNTER, "Spills", "spills", int),
        Stat("used_bytes", Kind.GAUGE, "Bytes held", "used_bytes", int),
        Stat("ratio", Kind.GAUGE, "A share", None, float),
        Stat("up", Kind.GAUGE, "1 while up", "up", bool),
    )


def test_a_field_declared_otherwise_is_refused() -> None:
    @dataclass
    class Loose:
        num_puts: int = counter("puts", "Completed puts")
        num_gets: int = 0

    with pytest.raises(TypeError, match=r"Loose\.num_gets is not declared"):
        declared(Loose)


def test_counters_start_at_zero_and_a_snapshot_must_read_every_gauge() -> None:
    counters = Counters()
    counters.num_puts += 2
    assert values(counters) == {"num_puts": 2, "bytes_in": 0}
    assert not hasattr(counters, "__dict__")  # slots: increments stay plain and cheap
    with pytest.raises(TypeError, match="used_bytes"):
        Stats(**values(counters), ratio=0.5, up=True)
    stats = Stats(**values(counters), num_spills=1, used_bytes=7, ratio=0.5, up=True)
    assert values(stats) == {"num_puts": 2, "bytes_in": 0, "num_spills": 1, "used_bytes": 7,
                             "ratio": 0.5, "up": True}


async def test_collector_exports_each_declared_metric_from_the_snapshot() -> None:
    stats = Stats(num_puts=3, bytes_in=4096, num_spills=1, used_bytes=7, ratio=0.5, up=True)
    registry = CollectorRegistry()
    registry.register(StatsCollector("svc_", lambda: stats, asyncio.get_running_loop(),
                                     declared(Stats)))
    text = (await asyncio.to_thread(generate_latest, registry)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    exported = {name: (f.type, f.documentation, [(s.name, s.value) for s in f.samples])
                for name, f in families.items()}
    assert exported == {
        "svc_puts": ("counter", "Completed puts", [("svc_puts_total", 3)]),
        "svc_bytes_in": ("counter", "Bytes received", [("svc_bytes_in_total", 4096)]),
        "svc_spills": ("counter", "Spills", [("svc_spills_total", 1)]),
        "svc_used_bytes": ("gauge", "Bytes held", [("svc_used_bytes", 7)]),
        "svc_up": ("gauge", "1 while up", [("svc_up", 1)]),
    }


async def test_a_scrape_filtered_by_name_gets_the_named_metrics() -> None:
    """/metrics?name[]=... (prometheus_client's restricted registry) matches
    names against what a collector describes: it found none of these."""
    stats = Stats(num_puts=3, bytes_in=4096, num_spills=1, used_bytes=7, ratio=0.5, up=True)
    registry = CollectorRegistry()
    registry.register(StatsCollector("svc_", lambda: stats, asyncio.get_running_loop(),
                                     declared(Stats)))
    only = registry.restricted_registry(["svc_puts_total", "svc_used_bytes"])
    text = (await asyncio.to_thread(generate_latest, only)).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples == {"svc_puts_total": 3, "svc_used_bytes": 7}
