"""The engine reports every preemption, either mode, and feeds the cost model.

A fake worker link (no process) runs the steps and the copies; the requests'
Generate spans come from a local tracer provider with an in-memory exporter,
and the metrics are read from the engine's own registry."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common.binding import free_port
from kvstash.common.sampling import SamplingParams
from scheduler_svc.cache_link import CacheLink
from scheduler_svc.core.config import PreemptionMode, ReservationPolicy
from scheduler_svc.core.outputs import OffloadCommand, RestoreCommand, SchedulerOutput
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.streams import RequestStream
from scheduler_svc.worker_link import CopyOutcome
from tests.scheduler_svc.factories import make_scheduler, teach_costs

P = "kvstash_scheduler_"


class FakeStream:
    """An Execute stream: every sampled seq gets token 7, after a short while."""

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        pass

    def add_done_callback(self, callback: Callable[[], object]) -> None:
        pass

    async def step(self, output: SchedulerOutput) -> dict[str, int]:
        await asyncio.sleep(0.001)
        return {seq.request_id: 7 for seq in output.seqs if seq.sample}


class FakeWorkerLink:
    """Copies that succeed: 100 bytes per block."""

    retry_s = 0.01

    async def wait_ready(self, deadline: float | None = None) -> bool:
        return True

    async def open(self) -> FakeStream:
        return FakeStream()

    async def offload(self, cmd: OffloadCommand, timeout_s: float) -> CopyOutcome:
        await asyncio.sleep(0.002)
        return CopyOutcome(100 * len(cmd.block_ids))

    async def restore(self, cmd: RestoreCommand, timeout_s: float) -> CopyOutcome:
        await asyncio.sleep(0.002)
        return CopyOutcome(100 * len(cmd.block_ids))


async def finished(stream: RequestStream) -> None:
    while True:
        event = await asyncio.wait_for(stream.events.get(), 10)
        assert not isinstance(event, Exception), event
        if event.finish_status is not None:
            return


async def run_pressured(core: Scheduler) -> tuple[list[trace.Event], SchedulerMetrics]:
    """Two traced requests on a 4-block pool (block_size 2): "b" is preempted
    at its second step. Returns "b"'s Generate span events and the metrics."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    metrics = SchedulerMetrics(core, asyncio.get_running_loop())
    engine = Engine(core, FakeWorkerLink(), None, EngineConfig(tracing=True),  # type: ignore[arg-type]
                    metrics=metrics)
    spans = {rid: tracer.start_span(f"Generate {rid}") for rid in ("a", "b")}
    streams = []
    for rid, prompt, max_tokens in (("a", [1, 2], 6), ("b", [40, 41, 42, 43], 4)):
        with trace.use_span(spans[rid], end_on_exit=False):
            streams.append(engine.submit(
                rid, prompt, SamplingParams(max_tokens, ignore_eos=True)))
    await engine.start()
    try:
        await asyncio.gather(*map(finished, streams))
    finally:
        await engine.close()
    for span in spans.values():
        span.end()
    [b_span] = [s for s in exporter.get_finished_spans() if s.name == "Generate b"]
    return list(b_span.events), metrics


def pressured_core(mode: PreemptionMode) -> Scheduler:
    return make_scheduler(num_blocks=4, block_size=2, preemption_mode=mode,
                          reservation_policy=ReservationPolicy.FIXED_BLOCKS,
                          fixed_blocks_per_decode=0, bytes_per_block=100)


async def sample(metrics: SchedulerMetrics, name: str, **labels: str) -> float | None:
    # Off the event loop: collecting reads the core's figures on the loop.
    return await asyncio.to_thread(metrics.registry.get_sample_value, P + name, labels)


@pytest.mark.parametrize(("mode", "taught", "chosen", "reason"), [
    (PreemptionMode.OFFLOAD, False, "offload", "forced"),
    (PreemptionMode.RECOMPUTE, False, "recompute", "forced"),
    (PreemptionMode.AUTO, False, "recompute", "cache_unavailable"),  # no cache configured
    (PreemptionMode.AUTO, True, "recompute", "cheaper"),
])
async def test_each_preemption_is_an_event_and_a_count_by_mode_and_reason(
    mode: PreemptionMode, taught: bool, chosen: str, reason: str
) -> None:
    core = pressured_core(mode)
    if taught:  # copies take seconds, recomputing milliseconds
        teach_costs(core.preemption.costs, (5.0, 0.0), (5.0, 0.0), (1e-3, 0.0))
        core.set_cache_available(True)
    events, metrics = await run_pressured(core)

    [event] = [e for e in events if e.name == "preempted"]
    attributes = dict(event.attributes or {})
    assert (attributes.pop("mode"), attributes.pop("reason")) == (chosen, reason)
    assert (attributes.pop("num_tokens"), attributes.pop("num_blocks")) == (4, 2)
    if taught:
        assert attributes.pop("predicted_offload_restore_s") == pytest.approx(10.0, rel=1e-6)
        # Taught 4 ms, but the engine's own (fake, faster) steps count too.
        assert 0 < attributes.pop("predicted_recompute_s") < 1  # type: ignore[operator]
    assert attributes == {}  # nothing predicted before the model is taught
    assert await sample(metrics, "preemptions_total", mode=chosen, reason=reason) == 1
    stats = core.stats()
    assert stats.num_preemptions_offload + stats.num_preemptions_recompute == 1
    assert await sample(metrics, f"preemptions_{chosen}_total") == 1
    # The steps were timed: the cost model saw the prefills.
    assert core.preemption.costs.num_prefill_steps > (8 if taught else 0)


async def test_copies_are_timed_and_the_learned_rates_are_gauges() -> None:
    core = pressured_core(PreemptionMode.OFFLOAD)
    _, metrics = await run_pressured(core)
    costs = core.preemption.costs
    assert (costs.num_offloads, costs.num_restores) == (1, 1)
    # Not yet trusted (min_cost_samples 4): NaN.
    value = await sample(metrics, "cost_offload_seconds_per_block")
    assert value is not None and math.isnan(value)
    teach_costs(costs, (0.01, 2e-4), (0.005, 1e-4), (1e-4, 1e-7))
    estimates = core.cost_estimates()
    for name, metric in (("offload_s_per_block", "offload_seconds_per_block"),
                         ("restore_s_fixed", "restore_fixed_seconds"),
                         ("prefill_s_per_token_squared", "prefill_seconds_per_token_squared"),
                         ("crossover_tokens", "crossover_tokens")):
        assert await sample(metrics, "cost_" + metric) == getattr(estimates, name), name
    assert estimates.crossover_tokens is not None and estimates.crossover_tokens > 0


async def test_a_prefix_lookup_the_cache_did_not_answer_is_no_miss() -> None:
    """A cache service nobody listens for (a real channel, refused): the
    request prefills, and its lookup counts as unanswered, not as a miss
    (which would read as the tier not holding the prompt)."""
    core = make_scheduler(prefix_segment_blocks=1, prefix_tier_salt="tiny")
    metrics = SchedulerMetrics(core, asyncio.get_running_loop())
    client = CacheClient(f"127.0.0.1:{free_port()}")
    engine = Engine(core, FakeWorkerLink(), CacheLink(client),  # type: ignore[arg-type]
                    metrics=metrics)
    await engine.start()
    try:
        await finished(await engine.admit("a", [1, 2, 3, 4] * 4, SamplingParams(2)))
    finally:
        await engine.close()
        await client.close()
    counts = {result: await sample(metrics, "prefix_tier_lookups_total", result=result)
              for result in ("hit", "miss", "unanswered")}
    assert counts == {"hit": 0, "miss": 0, "unanswered": 1}
