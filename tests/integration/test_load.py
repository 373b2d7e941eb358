"""The load test, short (`make load` runs the long one): a steady phase below
the scheduler's queue limit, a flood above it, then an ordinary request."""

from __future__ import annotations

from bench.load_test import OK, LoadConfig, format_report, run_load

# Below the queue limit: 8 clients <= max_num_waiting 8. The flood: 24 clients
# > max_num_seqs 4 + max_num_waiting 8. Each phase 3 s, then drained.
CONFIG = LoadConfig(
    num_clients=8, num_flood_clients=24, duration_s=3.0, max_tokens=8,
    min_prompt_tokens=8, max_prompt_tokens=32, max_num_seqs=4, max_num_waiting=8,
    num_blocks=128, cache_memory_budget="64MiB", drain_timeout_s=60.0,
)
# Generous bounds on each service's lifetime peak RSS (VmHWM, start-up
# included). Measured on the 2-core CI machine: scheduler ~50 MiB, worker
# (torch, tiny model) ~300 MiB, cache ~45 MiB plus its 64 MiB arena, which is
# mapped populated and so counts whole. A leak of a few KiB per request over a
# few hundred requests stays inside them; a copy per request of anything
# large does not.
PEAK_RSS_BOUND_MIB = {"scheduler": 256, "worker": 1024, "cache": 64 + 192}


def test_load_steady_then_flood_then_still_serving() -> None:
    report = run_load(CONFIG)
    table = format_report(report)
    steady, flood = report.steady, report.flood

    assert steady.errors == {}, table
    assert steady.num_completed > 0, table
    assert steady.ttft_ms is not None and steady.tpot_ms is not None, table

    assert flood.errors.get("RESOURCE_EXHAUSTED", 0) > 0, table
    assert set(flood.errors) == {"RESOURCE_EXHAUSTED"}, table
    assert flood.num_completed > 0, table  # refusing some, it still served others

    assert report.probe.outcome == OK, table
    assert report.probe.num_tokens == CONFIG.max_tokens, table
    assert report.exited == [], table

    assert set(report.lifetime_peak_rss_mib) == set(PEAK_RSS_BOUND_MIB), table
    for name, bound in PEAK_RSS_BOUND_MIB.items():
        assert report.lifetime_peak_rss_mib[name] < bound, f"{name}\n{table}"
