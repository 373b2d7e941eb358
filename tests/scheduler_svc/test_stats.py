"""The scheduler's figures are declared once (Counters and SchedulerStats,
kvstash.common.stats): stats() copies every counter, and GetStats carries every
declared stat in a proto field of the same name and a matching type."""

from __future__ import annotations

from kvstash.common.stats import Kind, declared, values
from kvstash.v1 import scheduler_pb2
from scheduler_svc.core.outputs import Counters, SchedulerStats
from scheduler_svc.server import stats_to_proto
from tests.scheduler_svc.factories import make_scheduler
from tests.stats_helpers import count_distinct, proto_mismatches


def test_get_stats_proto_matches_the_declared_stats_one_to_one() -> None:
    """Adding a stat without its proto field (or one of the wrong type) fails here."""
    assert proto_mismatches(declared(SchedulerStats),
                            scheduler_pb2.SchedulerStats.DESCRIPTOR) == []


def test_every_counter_reaches_stats_and_the_proto_under_its_own_name() -> None:
    core = make_scheduler()
    count_distinct(core._counters)
    stats = core.stats()
    counted = values(core._counters)
    assert {name: getattr(stats, name) for name in counted} == counted
    proto = stats_to_proto(stats)
    assert all(getattr(proto, name) == value for name, value in values(stats).items())
    assert (stats.num_total_blocks, stats.block_size, stats.num_free_blocks) == (64, 4, 64)


def test_counters_are_plain_slots_declared_as_counters() -> None:
    """The step loop increments them in place: no __dict__, no descriptors."""
    assert not hasattr(Counters(), "__dict__")
    assert {s.kind for s in declared(Counters)} == {Kind.COUNTER}
    assert values(Counters()) == dict.fromkeys(values(Counters()), 0)


def test_each_exported_metric_has_its_own_name() -> None:
    metrics = [s.metric for s in declared(SchedulerStats) if s.metric is not None]
    assert len(metrics) == len(set(metrics))
    assert "block_size" not in metrics  # GetStats only: configuration, not a figure
