"""The cache's proto conversions: nothing dropped on the way."""

from __future__ import annotations

import dataclasses

from cache_svc.convert import stats_to_proto
from cache_svc.model import CacheStats
from kvstash.stats import declared
from kvstash.v1 import cache_pb2
from tests.stats_helpers import proto_mismatches


def test_stats_proto_and_domain_stats_have_the_same_fields() -> None:
    """A proto field the store never fills would read 0 forever; a domain field
    missing from the proto would fail GetStats."""
    domain = {f.name for f in dataclasses.fields(CacheStats)}
    assert domain == {f.name for f in cache_pb2.CacheStats.DESCRIPTOR.fields}
    stats = CacheStats(**{name: i + 1 for i, name in enumerate(sorted(domain))})
    proto = stats_to_proto(stats)
    assert all(getattr(proto, name) == getattr(stats, name) for name in domain)


def test_stats_proto_matches_the_declared_stats_one_to_one() -> None:
    """Adding a stat without its proto field (or one of the wrong type) fails here."""
    assert proto_mismatches(declared(CacheStats), cache_pb2.CacheStats.DESCRIPTOR) == []
