"""The scheduler's Prometheus endpoint: every declared stat exported as
declared, and over a real stack and a preempting workload, every figure
agrees with the requests sent and with GetStats."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cache_svc.metrics import TransferMetrics
from cache_svc.model import CacheStats
from kvstash.client import Client
from kvstash.common import rpc_connections, settings
from kvstash.common.binding import free_port
from kvstash.common.stats import declared
from kvstash.common.tokenizer import ByteTokenizer
from kvstash.launch.stack import StackConfig, running_stack
from kvstash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.backend import Backend
from scheduler_svc.core.config import PreemptionMode, Role
from scheduler_svc.core.outputs import SchedulerStats
from scheduler_svc.core.preemption import REMEASURE_EVERY
from scheduler_svc.engine import Engine
from scheduler_svc.flags import parse_args
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.serving import create_scheduler_server
from tests.integration.workload import (
    MAX_TOKENS,
    PRESSURED_BLOCKS,
    PRESSURED_SCHEDULER_ARGS,
    prompts,
    wait_drained,
)
from tests.metrics_helpers import scrape
from tests.scheduler_svc.factories import make_scheduler, teach_costs
from tests.scheduler_svc.test_engine_reports import FakeWorkerLink
from tests.scheduler_svc.test_server import HeldTokenizer, abort_while_tokenized, attach
from tests.stats_helpers import count_distinct

P = "kvstash_scheduler_"
# A third of the integration workload: enough to preempt, quick on 2 cores.
PROMPTS = prompts()[:8]
NUM_REQUESTS = len(PROMPTS)


async def test_every_declared_stat_is_exported_with_its_kind_help_and_value() -> None:
    core = make_scheduler()
    count_distinct(core._counters)
    metrics = SchedulerMetrics(core, asyncio.get_running_loop())
    text = (await asyncio.to_thread(generate_latest, metrics.registry)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    stats = core.stats()
    for stat in declared(SchedulerStats):
        if stat.metric is None:
            assert P + stat.name not in families
            continue
        family = families.pop(P + stat.metric)
        assert (family.type, family.documentation) == (stat.kind.value, stat.doc), stat.name
        assert [s.value for s in family.samples] == [getattr(stats, stat.name)], stat.name
    assert families.pop(P + "kv_usage_ratio").samples[0].value == stats.kv_usage_ratio
    # Besides the learned costs, histograms and their _created times, only
    # the labelled counters are left.
    rest = {name for name, family in families.items()
            if family.type in ("counter", "gauge") and not name.endswith("_created")
            and not name.startswith(P + "cost_")}
    assert rest == {P + "finished_requests_by_reason", P + "preemptions",
                    P + "prefix_tier_lookups", P + "prefix_tier_found_segments"}


async def test_metrics_agree_with_a_preempting_workload(tmp_path: Path) -> None:
    port = free_port()
    config = StackConfig(
        num_blocks=PRESSURED_BLOCKS, preemption_mode="offload",
        scheduler_args=(*PRESSURED_SCHEDULER_ARGS, "--metrics-port", str(port),
                        "--metrics-host", "127.0.0.1"))
    with running_stack(config, tmp_path) as stack:
        usage: list[float] = []

        async def sample_usage() -> None:
            while True:
                usage.append((await asyncio.to_thread(scrape, port))[P + "kv_usage_ratio"])
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample_usage())
        async with Client(stack.address) as client:
            await asyncio.gather(*[client.complete(p, max_tokens=MAX_TOKENS, ignore_eos=True)
                                   for p in PROMPTS])
        sampler.cancel()
        stats = await wait_drained(stack.address)
        m = scrape(port)

    assert usage and all(0 <= u <= 1 for u in usage) and max(usage) > 0.5
    assert m[P + "kv_usage_ratio"] == 0  # drained: cached prefixes are not usage
    assert m[P + "cache_available"] == 1
    reasons = {r: m[P + f"finished_requests_by_reason_total{{reason={r}}}"]
               for r in ("stop", "length", "abort")}
    assert reasons == {"stop": 0, "length": NUM_REQUESTS, "abort": 0}
    assert m[P + "finished_requests_total"] == NUM_REQUESTS
    assert m[P + "prompt_tokens_total"] == sum(len(p) for p in PROMPTS)
    assert m[P + "generation_tokens_total"] == NUM_REQUESTS * MAX_TOKENS
    for name in ("queue_time", "ttft", "time_per_output_token", "e2e_request_latency"):
        assert m[P + f"{name}_seconds_count"] == NUM_REQUESTS, name
        assert m[P + f"{name}_seconds_sum"] > 0, name
    assert m[P + "e2e_request_latency_seconds_sum"] > m[P + "ttft_seconds_sum"]
    # Every offload and restore succeeded, and each was timed once.
    assert stats.num_offload_failures == stats.num_restore_failures == 0
    assert m[P + "offload_seconds_count"] == stats.num_preemptions_offload > 0
    assert m[P + "restore_seconds_count"] == stats.num_preemptions_offload
    assert m[P + "offload_seconds_sum"] > 0 and m[P + "restore_seconds_sum"] > 0
    assert m[P + "preemptions_offload_total"] == stats.num_preemptions_offload


def test_metrics_host_is_validated_and_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse_args([]).metrics_host == "127.0.0.1"
    assert parse_args(["--metrics-host", "::"]).metrics_host == "::"
    monkeypatch.setenv(settings.env_name("scheduler", "--metrics-host"), "0.0.0.0")
    assert parse_args([]).metrics_host == "0.0.0.0"
    for bad in ("", "bad host", "x" * 300):
        with pytest.raises(SystemExit):
            parse_args(["--metrics-host", bad])


async def test_every_preemption_the_core_can_choose_is_counted() -> None:
    """Each (mode, reason) has its counter: one the metrics did not know
    would raise in the step loop. AUTO with recompute predicted cheaper
    chooses both of its reasons within REMEASURE_EVERY victims."""
    core = make_scheduler(preemption_mode=PreemptionMode.AUTO)
    teach_costs(core.preemption.costs, (10.0, 0.0), (10.0, 0.0), (1e-6, 0.0))
    core.set_cache_available(True)
    metrics = SchedulerMetrics(core, asyncio.get_running_loop())
    for i in range(REMEASURE_EVERY):
        metrics.observe_preemption(core.preemption.choose(f"v{i}", 41))
    samples = {(s.labels["mode"], s.labels["reason"]): s.value
               for family in text_string_to_metric_families(
                   (await asyncio.to_thread(generate_latest, metrics.registry)).decode())
               for s in family.samples if s.name == "kvstash_scheduler_preemptions_total"}
    assert samples[("recompute", "cheaper")] == REMEASURE_EVERY - 1
    assert samples[("offload", "remeasure")] == 1


async def test_a_decode_instances_part_of_a_pd_request_is_not_counted_as_a_request() -> None:
    """The prefill instance counts a handed-off request once, from its
    client's arrival; the decode instance's Decode call counting it too
    doubled every P/D request in finished_requests_by_reason summed over
    the pools, and put the time to its *second* token in the TTFT
    histogram. A decode instance over a real channel; its worker's steps
    and copies are a fake link's."""
    core = make_scheduler(role=Role.DECODE, bytes_per_block=100)
    loop = asyncio.get_running_loop()
    metrics = SchedulerMetrics(core, loop)
    engine = Engine(core, FakeWorkerLink(), None, metrics=metrics)  # type: ignore[arg-type]
    await engine.start()
    server = await create_scheduler_server("127.0.0.1:0")
    try:
        await asyncio.wait_for(engine.wait_until_worker_up(), 10)
        server.attach(Backend(engine, ByteTokenizer(), metrics))
        async with rpc_connections.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            prompt = scheduler_pb2.TokenIds(ids=[1, 2, 3, 4, 5])
            reply = await stub.ReserveBlocks(scheduler_pb2.ReserveBlocksRequest(
                request_id="r", prompt=prompt, sampling=common_pb2.SamplingParams(
                    max_tokens=4, ignore_eos=True),
                block_size=core.config.block_size, bytes_per_block=100))
            assert reply.accepted
            responses = [r async for r in stub.Decode(scheduler_pb2.DecodeRequest(
                request_id="r", snapshot_id="prefill-r-0", num_tokens=5, first_token_id=9))]
        assert responses[-1].finish_reason == scheduler_pb2.FINISH_REASON_LENGTH
        assert sum(len(r.token_ids) for r in responses) == 3  # the first came from prefill
        assert core.stats().num_generation_tokens == 3
        values = {name: await asyncio.to_thread(metrics.registry.get_sample_value, P + name,
                                                {"reason": "length"} if "reason" in name else {})
                  for name in ("finished_requests_by_reason_total", "ttft_seconds_count",
                               "time_per_output_token_seconds_count",
                               "e2e_request_latency_seconds_count")}
        assert values == dict.fromkeys(values, 0.0)
    finally:
        await server.server.stop(None)
        await engine.close()


async def test_metric_names_spell_their_units_as_prometheus_does() -> None:
    """`_seconds`, never `_s` (the learned costs were `..._s_per_block`):
    the scheduler's and the cache's every metric."""
    metrics = SchedulerMetrics(make_scheduler(), asyncio.get_running_loop())
    text = (await asyncio.to_thread(generate_latest, metrics.registry)).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    names |= {"kvstash_cache_" + s.metric for s in declared(CacheStats) if s.metric}
    names |= {f.name for f in TransferMetrics().registry.collect()}
    assert P + "cost_offload_seconds_per_block" in names
    assert [n for n in names if re.search(r"_s(_|$)", n)] == []


async def test_a_scrape_while_the_event_loop_is_blocked_still_answers() -> None:
    """The figures read on the event loop wait for it a bounded time; a loop
    blocked past that left the whole scrape an HTTP 500 (and a traceback in
    the log) at every scrape. Now the scrape answers with what needs no loop
    (the histograms and labelled counters), without the loop's figures,
    soon enough for a 10 s scrape timeout; the next scrape has them all."""
    metrics = SchedulerMetrics(make_scheduler(), asyncio.get_running_loop())
    server = metrics.serve(0, "127.0.0.1")
    try:
        scraped: dict[str, object] = {}

        def scrape_once() -> None:
            started = time.monotonic()
            try:
                scraped["samples"] = scrape(server.port)
            except Exception as exc:
                scraped["samples"] = exc
            scraped["seconds"] = time.monotonic() - started

        scraper = threading.Thread(target=scrape_once)
        scraper.start()
        scraper.join(60)  # on the event loop: blocks it until the scrape ends
        samples, seconds = scraped["samples"], scraped["seconds"]
        assert isinstance(samples, dict), samples
        assert samples[P + "ttft_seconds_count"] == 0
        assert P + "num_free_blocks" not in samples and P + "cost_crossover_tokens" not in samples
        assert isinstance(seconds, float) and seconds < 9
        assert P + "num_free_blocks" in await asyncio.to_thread(scrape, server.port)
    finally:
        server.stop()


async def test_a_request_aborted_while_its_prompt_is_tokenized_counts_alike_everywhere(
) -> None:
    """The core never took a request an Abort ended while its long prompt
    was tokenized (on a thread): it counted in finished_requests_by_reason
    {abort} (and the e2e histogram) but not in finished_requests, so the
    two disagreed on /metrics. Counted in neither now, as the VllmEngine
    API never counted one; a request the core took counts in both. Over a
    real channel; the engine never runs (no worker needed)."""
    tokenizer = HeldTokenizer()
    core = make_scheduler(vocab_size=258, max_model_len=20_000, num_blocks=5_000)
    server = await create_scheduler_server("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel("127.0.0.1:1") as nowhere, \
                rpc_connections.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            attach(server, nowhere, core, tokenizer=tokenizer)
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            call = await abort_while_tokenized(stub, tokenizer, "long")
            async with asyncio.timeout(10):
                responses = [r async for r in call]
            assert responses[-1].finish_reason == scheduler_pb2.FINISH_REASON_ABORT
            # One the core took, aborted while queued (the engine never steps).
            taken = stub.Generate(scheduler_pb2.GenerateRequest(
                request_id="taken", token_ids=scheduler_pb2.TokenIds(ids=[1, 2, 3]),
                sampling=common_pb2.SamplingParams(max_tokens=4)))
            async with asyncio.timeout(10):
                while core.get_request("taken") is None:
                    await asyncio.sleep(0.01)
            await stub.Abort(scheduler_pb2.AbortRequest(request_id="taken"))
            async with asyncio.timeout(10):
                assert [r async for r in taken][-1].finish_reason == (
                    scheduler_pb2.FINISH_REASON_ABORT)
        metrics = server.attached().metrics
        samples = {name: await asyncio.to_thread(metrics.registry.get_sample_value, P + name,
                                                 {"reason": "abort"} if "reason" in name else {})
                   for name in ("finished_requests_by_reason_total",
                                "e2e_request_latency_seconds_count")}
        assert samples == dict.fromkeys(samples, core.stats().num_finished)
        assert core.stats().num_finished == 1
    finally:
        await server.server.stop(None)
