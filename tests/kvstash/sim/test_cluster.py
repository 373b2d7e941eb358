"""The real scheduler core in virtual time: every request ends, nothing
leaks, each policy does what it says, runs repeat exactly, routers route."""

from __future__ import annotations

import dataclasses

import pytest

from kvstash.sim.cache import SimCache
from kvstash.sim.cluster import Cluster, SimResult
from kvstash.sim.profile import parse_profile
from kvstash.sim.routers import PrefixAware, least_load
from kvstash.workload.trace import Trace, TraceRequest, synthetic
from scheduler_svc.core.config import POLICIES, SchedulerConfig
from tests.kvstash.sim.test_profile import GOOD

PROFILE = parse_profile(GOOD)
# Prompts of ~128 tokens and outputs of ~96 on a pool of 64 blocks of 16:
# a handful of requests fill it, and decodes must be preempted.
TRACE = synthetic(48, rate=40.0, input_mean=128, output_mean=96, shared_blocks=0, seed=3,
                  block_tokens=64)


def simulate(policy: str, instances: int = 1, host_bytes: int = 1 << 30,
             disk_bytes: int = 0, router: str = "round-robin") -> tuple[SimResult, Cluster]:
    mode, reservation = POLICIES[policy]
    configs = [SchedulerConfig(num_blocks=64, block_size=16, max_model_len=1024,
                               vocab_size=1 << 20, max_num_seqs=16, max_num_batched_tokens=256,
                               preemption_mode=mode, reservation_policy=reservation,
                               bytes_per_block=PROFILE.bytes_per_block,
                               snapshot_id_prefix=f"i{n}")
               for n in range(instances)]
    cluster = Cluster(configs, PROFILE, SimCache(host_bytes, disk_bytes), router=router)
    return cluster.run(TRACE), cluster


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_request_ends_and_nothing_is_left_behind(policy: str) -> None:
    result, cluster = simulate(policy)  # run() ends with each core's check_integrity
    assert all(r.ok and r.num_tokens == q.output_length
               for r, q in zip(result.records, TRACE.requests, strict=True))
    assert cluster.cache.snapshots == {} and cluster.cache.used == {"host": 0, "disk": 0}
    assert all(inst.core.is_idle and not inst.held for inst in cluster.instances)
    c = result.counters
    assert c["num_preemptions_offload"] + c["num_preemptions_recompute"] > 0  # pressure
    if policy.startswith("recompute"):
        assert c["num_preemptions_offload"] == 0 and c["num_recomputed_tokens"] > 0
    if policy.startswith("offload"):
        assert c["num_preemptions_recompute"] == 0 and c["num_recomputed_tokens"] == 0
        assert c["bytes_offloaded"] == c["bytes_restored"] > 0


def test_hash_ids_past_32_bits_are_served_and_share_what_they_share() -> None:
    """A trace's hash ids become tokens numbered as first seen: an id past the
    core's 32-bit tokens failed its request (InvalidArgument), silently
    (found in review, 2026-11-28)."""
    big = 1 << 40
    trace = Trace((TraceRequest(0.0, 128, 4, (big, big + 1)),
                   TraceRequest(5.0, 128, 4, (big, big + 2))), block_tokens=64)
    configs = [SchedulerConfig(num_blocks=64, block_size=16, max_model_len=1024,
                               vocab_size=1 << 32, bytes_per_block=PROFILE.bytes_per_block)]
    result = Cluster(configs, PROFILE, SimCache(1 << 30, 0)).run(trace)
    assert all(r.ok and r.num_tokens == 4 for r in result.records)
    assert result.counters["num_prefix_hit_tokens"] == 64  # the shared first block


def test_a_run_repeats_exactly() -> None:
    first, _ = simulate("auto")
    second, _ = simulate("auto")
    assert [dataclasses.astuple(r) for r in first.records] == [
        dataclasses.astuple(r) for r in second.records]
    assert first.counters == second.counters


def test_a_full_cache_means_recompute_and_a_small_memory_tier_spills() -> None:
    refused, _ = simulate("offload", host_bytes=0)
    assert refused.counters["num_offload_failures"] > 0
    assert refused.counters["num_recomputed_tokens"] > 0
    assert all(r.ok for r in refused.records)
    spilled, _ = simulate("offload", host_bytes=0, disk_bytes=1 << 30)
    assert spilled.counters["num_offload_failures"] == 0
    assert max(s.disk_bytes for s in spilled.samples) > 0
    assert all(s.host_bytes == 0 for s in spilled.samples)


def test_round_robin_spreads_and_least_load_picks_the_emptiest() -> None:
    _, cluster = simulate("auto", instances=3)
    assert [inst.routed for inst in cluster.instances] == [16, 16, 16]
    assert all(inst.core.stats().num_generation_tokens > 0 for inst in cluster.instances)
    _, cluster = simulate("auto", instances=3, router="least-load")
    assert sum(inst.routed for inst in cluster.instances) == 48
    instances = cluster.instances
    instances[0].held.update({"a", "b"})
    instances[2].held.add("c")
    assert least_load(instances, TRACE.requests[0]) is instances[1]


def conversations(num: int = 7, turns: int = 4) -> Trace:
    """Multi-turn chats: each turn's prompt is the last one's and more, turns
    of different chats interleaved in arrival order (7 chats: round-robin over
    4 instances moves each chat from turn to turn)."""
    requests: list[TraceRequest] = []
    for turn in range(turns):
        for chat in range(num):
            ids = tuple(1000 * chat + i for i in range(2 * turn + 2))
            requests.append(TraceRequest(len(requests) * 0.2, 64 * len(ids) - 10, 8, ids))
    return Trace(tuple(requests), block_tokens=64)


def test_prefix_aware_routing_keeps_a_chat_where_its_prefix_is_cached() -> None:
    trace = conversations()
    hits = {}
    for router in ("round-robin", "prefix-aware"):
        configs = [SchedulerConfig(num_blocks=256, block_size=16, max_model_len=1024,
                                   vocab_size=1 << 20, snapshot_id_prefix=f"i{n}")
                   for n in range(4)]
        cluster = Cluster(configs, PROFILE, SimCache(1 << 30, 0), router=router)
        result = cluster.run(trace)
        assert all(r.ok for r in result.records)
        hits[router] = result.counters["num_prefix_hit_tokens"]
    # Every later turn finds its chat's earlier turns cached only when routed there.
    assert hits["prefix-aware"] > 2 * hits["round-robin"]


def test_prefix_aware_falls_back_to_the_least_loaded() -> None:
    _, cluster = simulate("auto", instances=3)
    route = PrefixAware(threshold=0.5, balance=4)
    a, b, c = cluster.instances
    first = TraceRequest(0.0, 100, 1, (1, 2, 3))
    assert route(cluster.instances, first) is a  # nothing known: the least loaded (first)
    a.held.update({"x", "y"})
    assert route(cluster.instances, TraceRequest(0.0, 100, 1, (1, 2, 3, 4))) is a  # 3 of 4 ids
    assert route(cluster.instances, TraceRequest(0.0, 100, 1, (1, 9, 9, 9))) is b  # 1 of 4
    a.held.update(str(i) for i in range(10))  # 12 held: more than 4 over the least
    b.held.add("z")
    assert route(cluster.instances, TraceRequest(0.0, 100, 1, (1, 2, 3, 5))) is c


def test_a_config_with_the_prefix_tier_is_refused() -> None:
    """The simulation models no prefix tier: a core asking for one would wait
    for copies that never come."""
    config = SchedulerConfig(num_blocks=64, block_size=16, max_model_len=1024,
                             vocab_size=1 << 20, prefix_segment_blocks=4, prefix_tier_salt="m")
    with pytest.raises(ValueError, match="no prefix tier"):
        Cluster([config], PROFILE, SimCache(1 << 30, 0))


def test_a_profile_measured_at_another_block_size_sizes_copies_by_the_runs_blocks() -> None:
    """A profile's bytes_per_block is for its own block_size: a run with
    blocks of 32 tokens on a profile of 16-token blocks copies twice a block's
    bytes, as the same costs stated at 32-token blocks do. The copies were
    sized by the profile's block whatever the run's (`kvstash sim --block-size
    32`: half the bytes, half the copy time, twice what the cache holds)."""
    configs = [SchedulerConfig(num_blocks=32, block_size=32, max_model_len=1024,
                               vocab_size=1 << 20, max_num_seqs=16, max_num_batched_tokens=256,
                               preemption_mode=POLICIES["offload"][0],
                               reservation_policy=POLICIES["offload"][1])]
    at_32 = parse_profile({**GOOD, "block_size": 32,
                           "bytes_per_block": 2 * GOOD["bytes_per_block"]})
    runs = [Cluster(configs, profile, SimCache(1 << 30, 0)).run(TRACE)
            for profile in (PROFILE, at_32)]
    assert runs[0].counters["bytes_offloaded"] > 0
    assert runs[0].counters == runs[1].counters
    assert [dataclasses.astuple(r) for r in runs[0].records] == [
        dataclasses.astuple(r) for r in runs[1].records]
