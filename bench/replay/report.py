"""A replay's results: the oracle (same greedy outputs in every run), the
terminal table, and the JSON (strict: a figure that has no value is null)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.replay.runs import RunResult
from kvstash.workload.metrics import RequestRecord, Slo, Summary, strict, summarize

MIB = 1 << 20


def label(run: RunResult) -> str:
    return f"{run.policy} @ {run.rate:.3g}/s"


def output_mismatches(runs: Sequence[RunResult]) -> list[str]:
    """Every request of the slice must complete in every run with the same
    output: greedy outputs depend on neither the policy nor the load. A
    request some run did not complete is a problem too (its output there
    went unchecked), as is one no run completed."""
    problems = []
    run_to_records = [{r.index: r for r in run.records} for run in runs]
    for index in sorted(set().union(*run_to_records)):
        done: list[tuple[str, list[int] | str]] = []
        missed = []
        for run, records in zip(runs, run_to_records, strict=True):
            record = records.get(index)
            if record is not None and record.ok:
                done.append((label(run), record.output))
            else:
                missed.append(f"{label(run)} ({failure(record)})")
        if not done:
            problems.append(f"request {index}: completed in no run, its output went unchecked")
            continue
        if missed:
            problems.append(f"request {index}: not completed in {', '.join(missed)}, so not "
                            f"compared with {done[0][0]}")
        first, output = done[0]
        for name, other in done[1:]:
            if other != output:
                at = next((i for i, (a, b) in enumerate(zip(other, output, strict=False))
                           if a != b), min(len(other), len(output)))
                problems.append(f"request {index}: {name} differs from {first} "
                                f"from output position {at}")
    return problems


def failure(record: RequestRecord | None) -> str:
    """Why a request did not complete."""
    if record is None:
        return "not sent"
    return record.error or "UNFINISHED"  # the stream ended without a finish


def failures(runs: Sequence[RunResult], num_shown: int = 3) -> list[str]:
    """A line for each run with failed requests: how many, the first few.
    A request never fails for lack of memory, so any failure is a bug."""
    lines = []
    for run in runs:
        if failed := [r for r in run.records if not r.ok]:
            first = ", ".join(f"request {r.index} {failure(r)}" for r in failed[:num_shown])
            lines.append(f"{label(run)}: {len(failed)} of {len(run.records)} requests failed "
                         f"({first}{', ...' if len(failed) > num_shown else ''})")
    return lines


def prefix_hit_rate(counters: dict[str, int]) -> float:
    """Of the tokens that needed KV at each admission (a recompute's again),
    the share a cached prefix supplied."""
    queried = counters["num_prefix_query_tokens"]
    return counters["num_prefix_hit_tokens"] / queried if queried else 0.0


def table(runs: Sequence[RunResult], slo: Slo) -> str:
    head = ("policy", "rate/s", "done", "fail", "req/s", "out tok/s", "goodput", "SLO %",
            "TTFT p50/p90/p99 ms", "TPOT p50/p99 ms", "ITL p50 ms", "E2E p50 s",
            "preempt off/rec", "recomputed tok", "MiB off/restored", "prefix hit %")
    rows = [head]
    for run in runs:
        s, c = summarize(run.records, slo), run.counters
        rows.append((
            run.policy, f"{run.rate:.3g}", str(s.num_completed), str(s.num_failed),
            f"{s.requests_per_s:.3f}", f"{s.output_tokens_per_s:.1f}", f"{s.goodput:.3f}",
            f"{100 * s.attainment:.0f}",
            "/".join(f"{1000 * s.ttft_s[p]:.0f}" for p in ("p50", "p90", "p99")),
            "/".join(f"{1000 * s.tpot_s[p]:.1f}" for p in ("p50", "p99")),
            f"{1000 * s.itl_s['p50']:.1f}", f"{s.e2e_s['p50']:.2f}",
            f"{c['num_preemptions_offload']}/{c['num_preemptions_recompute']}",
            str(c["num_recomputed_tokens"]),
            f"{c['bytes_offloaded'] / MIB:.0f}/{c['bytes_restored'] / MIB:.0f}",
            f"{100 * prefix_hit_rate(c):.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
             for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def summary_json(summary: Summary) -> dict[str, Any]:
    return dataclasses.asdict(summary)


def write_json(path: Path, runs: Sequence[RunResult], slo: Slo,
               setup: dict[str, Any]) -> None:
    body = {
        "setup": setup,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "runs": [{
            "policy": run.policy, "rate": run.rate,
            "summary": summary_json(summarize(run.records, slo)),
            "counters": run.counters, "prefix_hit_rate": prefix_hit_rate(run.counters),
            "occupancy": [dataclasses.asdict(o) for o in run.occupancy],
            "requests": [{"index": r.index, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s,
                          "e2e_s": r.e2e_s, "num_tokens": r.num_tokens, "error": r.error}
                         for r in run.records],
        } for run in runs],
    }
    path.write_text(json.dumps(strict(body), indent=1, allow_nan=False), encoding="utf-8")
