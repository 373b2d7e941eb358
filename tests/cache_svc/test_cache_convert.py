"""The cache's proto conversions: nothing dropped on the way."""

from __future__ import annotations

from cache_svc.convert import stats_to_proto
from cache_svc.model import CacheStats
from kvstash.common.stats import declared
from kvstash.v1 import cache_pb2
from tests.stats_helpers import proto_mismatches


def test_stats_proto_matches_the_declared_stats_one_to_one() -> None:
    """A proto field the store never fills would read 0 forever; a declared
    stat missing from the proto (or of another type) would fail GetStats."""
    assert proto_mismatches(declared(CacheStats), cache_pb2.CacheStats.DESCRIPTOR) == []
    names = [s.name for s in declared(CacheStats)]
    stats = CacheStats(**{name: i + 1 for i, name in enumerate(sorted(names))})
    proto = stats_to_proto(stats)
    assert all(getattr(proto, name) == getattr(stats, name) for name in names)
