"""P/D pools in virtual time: requests prefilled on one pool decode on the
other through the cache, and every way the edge's protocol bends (refused
reservations, a refused hand-off copy, one-token requests) still ends every
request, as the real edge does."""

from __future__ import annotations

import dataclasses

import pytest

from kvstash.sim.cache import SimCache
from kvstash.sim.cluster import Instance, SimResult
from kvstash.sim.pd import PdCluster, pd_configs
from kvstash.sim.profile import parse_profile
from kvstash.workload.trace import Trace, TraceRequest, synthetic
from scheduler_svc.core.outputs import RestoreCommand
from tests.kvstash.sim.test_profile import GOOD

PROFILE = parse_profile(GOOD)
TRACE = synthetic(32, rate=20.0, input_mean=128, output_mean=48, shared_blocks=0, seed=5,
                  block_tokens=64)


def simulate(trace: Trace = TRACE, decode_blocks: int = 256, host_bytes: int = 1 << 30,
             handoff_wait_s: float = 10.0, **settings: object) -> tuple[SimResult, PdCluster]:
    base = dict(num_blocks=256, block_size=16, max_model_len=1024, max_num_seqs=16,
                max_num_batched_tokens=256, bytes_per_block=PROFILE.bytes_per_block)
    prefill, decode = pd_configs("offload", 2, 2, **{**base, **settings})
    decode = [dataclasses.replace(config, num_blocks=decode_blocks) for config in decode]
    cluster = PdCluster(prefill, decode, PROFILE, SimCache(host_bytes, 0),
                        handoff_wait_s=handoff_wait_s)
    return cluster.run(trace), cluster  # run() ends with each core's check_integrity


def assert_all_served(result: SimResult, cluster: PdCluster, trace: Trace = TRACE) -> None:
    assert all(r.ok and r.num_tokens == q.output_length
               for r, q in zip(result.records, trace.requests, strict=True))
    assert all(inst.core.is_idle and not inst.held for inst in cluster.instances)
    assert cluster.cache.snapshots == {}  # every hand-off snapshot was restored


def test_prefilled_requests_decode_on_the_decode_pool() -> None:
    result, cluster = simulate()
    assert_all_served(result, cluster)
    c = result.counters
    assert c["num_handoffs"] == c["num_reservations_accepted"] == len(TRACE.requests)
    assert c["num_handoff_failures"] == c["num_reservations_expired"] == 0
    # Each pool did its part: prompts on one, all but the first token on the other.
    prefill = sum(i.core.stats().num_prompt_tokens for i in cluster.front)
    assert prefill == sum(q.input_length for q in TRACE.requests)
    decoded = sum(i.core.stats().num_generation_tokens for i in cluster.decoders)
    assert decoded == sum(q.output_length - 1 for q in TRACE.requests)
    assert all(i.routed for i in cluster.front) and not any(i.routed for i in cluster.decoders)


def test_refused_reservations_wait_then_decode_on_the_prefill_instance() -> None:
    """Decode instances too small for most prompts: a handed-off request
    waits out the hand-off wait, then the prefill instance takes it back and
    resumes it from its snapshot."""
    result, cluster = simulate(decode_blocks=12, handoff_wait_s=0.05)
    assert_all_served(result, cluster)
    c = result.counters
    assert c["num_reservations_refused"] > 0
    assert 0 < c["num_reservations_accepted"] < len(TRACE.requests)
    assert c["num_handoffs"] == len(TRACE.requests)  # each copied out before it was asked
    assert c["num_handoff_failures"] == len(TRACE.requests) - c["num_reservations_accepted"]


def test_a_refused_request_is_asked_once_more_at_the_deadline() -> None:
    """As the edge (decode_peers.py): rounds back off from 0.05 s, and the
    last is cut to the hand-off wait, not skipped because a full back-off
    would end past it (a wait of 0.07 s: asked at 0, 0.05 and 0.07 s)."""
    wait = 0.07
    base = dict(num_blocks=256, block_size=16, max_model_len=1024, max_num_seqs=16,
                max_num_batched_tokens=256, bytes_per_block=PROFILE.bytes_per_block)
    prefill, decode = pd_configs("offload", 2, 2, **base)
    decode = [dataclasses.replace(config, num_blocks=12) for config in decode]
    cluster = PdCluster(prefill, decode, PROFILE, SimCache(1 << 30, 0), handoff_wait_s=wait)
    asks: dict[str, list[float]] = {}
    reserve = cluster._reserve

    def asked(request_id: str, *args: object) -> object:
        asks.setdefault(request_id, []).append(cluster.now)
        decoder = reserve(request_id, *args)  # type: ignore[arg-type]
        if decoder is not None:
            asks.pop(request_id)  # only those never reserved are looked at
        return decoder

    cluster._reserve = asked  # type: ignore[method-assign]
    result = cluster.run(TRACE)
    assert all(r.ok for r in result.records)
    assert len(asks) == result.counters["num_handoff_failures"] > 0
    for times in asks.values():
        assert [t - times[0] for t in times] == pytest.approx([0, 0.05, wait])


def test_a_hand_off_whose_restore_fails_there_resumes_on_its_prefill_instance() -> None:
    """As the edge: a decode instance whose restore of a hand-off fails
    gives the request back, the snapshot left in the cache, and the prefill
    instance takes it back and resumes it from there: nothing recomputed."""
    base = dict(num_blocks=256, block_size=16, max_model_len=1024, max_num_seqs=16,
                max_num_batched_tokens=256, bytes_per_block=PROFILE.bytes_per_block)
    cluster = PdCluster(*pd_configs("offload", 2, 2, **base), PROFILE, SimCache(1 << 30, 0))
    restore = cluster._restore

    def failing_there(inst: Instance, cmd: RestoreCommand) -> None:
        if inst in cluster.decoders and cmd.snapshot_id.startswith("p"):  # a hand-in
            cluster.at(cluster.now, lambda: cluster._restored(inst, cmd, None, 0.0))
        else:
            restore(inst, cmd)

    cluster._restore = failing_there  # type: ignore[method-assign]
    result = cluster.run(TRACE)
    assert_all_served(result, cluster)
    c = result.counters
    assert c["num_handoffs"] == c["num_handoff_failures"] == len(TRACE.requests)
    assert c["num_restore_failures"] == len(TRACE.requests)  # there, not here
    assert c["num_recomputed_tokens"] == 0


def test_a_refusing_decode_pool_delays_the_second_token_not_the_first() -> None:
    """A decode instance is asked once the first token is sent: a longer
    wait for one delays what follows it, never the first token."""
    runs = [simulate(decode_blocks=12, handoff_wait_s=wait)[0] for wait in (0.05, 0.5)]
    ttft = [sum(r.chunk_times[0] - r.sent_s for r in x.records) for x in runs]
    second = [sum(r.chunk_times[1] - r.chunk_times[0] for r in x.records) for x in runs]
    assert second[1] > second[0] and ttft[1] <= ttft[0]


def test_no_reservation_expires_while_its_prefill_queues() -> None:
    """Decode blocks are reserved for KV already in the cache, and restored
    into at once: even reservations that last 2 ms never expire."""
    result, cluster = simulate(reservation_timeout_s=0.002)
    assert_all_served(result, cluster)
    c = result.counters
    assert c["num_reservations_expired"] == 0
    assert c["num_reservations_accepted"] == c["num_handoffs"] == len(TRACE.requests)


def test_a_refused_hand_off_copy_decodes_on_the_prefill_instance() -> None:
    result, cluster = simulate(host_bytes=0)  # the cache takes nothing
    assert_all_served(result, cluster)
    c = result.counters
    assert c["num_handoffs"] == c["num_reservations_accepted"] == 0  # none asked
    assert c["num_handoff_failures"] == len(TRACE.requests)


def test_one_token_requests_reserve_nothing() -> None:
    trace = dataclasses.replace(TRACE, requests=[
        dataclasses.replace(q, output_length=1) for q in TRACE.requests])
    result, cluster = simulate(trace)
    assert_all_served(result, cluster, trace)
    assert result.counters["num_reservations_accepted"] == result.counters["num_handoffs"] == 0


def test_a_pd_run_repeats_exactly() -> None:
    first, _ = simulate(reservation_timeout_s=0.002)
    second, _ = simulate(reservation_timeout_s=0.002)
    assert [dataclasses.astuple(r) for r in first.records] == [
        dataclasses.astuple(r) for r in second.records]
    assert first.counters == second.counters


def test_a_landed_hand_off_lets_the_prefill_instance_admit_the_next() -> None:
    """A prefill pool that holds one prompt at a time: the second waits for
    the first's blocks, which its landed hand-off frees, and that landing
    wakes the prefill instance (no other event would: the trace has ended)."""
    trace = Trace((TraceRequest(0.0, 200, 8, (0, 1, 2, 3)),
                   TraceRequest(0.0, 200, 8, (4, 5, 6, 7))), 64)
    base = dict(num_blocks=14, block_size=16, max_model_len=1024, max_num_seqs=16,
                max_num_batched_tokens=256, bytes_per_block=PROFILE.bytes_per_block)
    prefill, decode = pd_configs("offload", 1, 1, **base)
    decode = [dataclasses.replace(config, num_blocks=256) for config in decode]
    cluster = PdCluster(prefill, decode, PROFILE, SimCache(1 << 30, 0), handoff_wait_s=10.0)
    result = cluster.run(trace)
    assert_all_served(result, cluster, trace)
    assert result.counters["num_handoffs"] == 2
    first, second = result.records
    assert second.chunk_times[0] > first.chunk_times[0]  # it waited for the first's blocks
