"""Cross-check the replayer with aiperf (a load tool nobody here wrote): the
same fitted trace slice through smg, each tool against a fresh tiny-model
stack, p50s side by side.

    python -m bench.replay.aiperf_check --aiperf /path/to/venv/bin/aiperf [--rounds 3]

aiperf (`pip install aiperf` into a venv of its own: its pins are not ours)
replays the slice with `--custom-dataset-type mooncake_trace --fixed-schedule`,
building its own text prompts from the hash ids, counting tokens with the
tiny model's tokenizer (exported here, offered to it as a local Hugging Face
cache under a temporary HF_HOME: aiperf resolves a tokenizer directory only
through that cache). Its "inter token latency" is per request (last token -
first) / (tokens - 1), the replayer's TPOT; its "inter chunk latency" the
replayer's ITL. Requests the slice sends at once are sent 10 ms apart in its
order (`spaced`): at once, each tool sent them in its own order, and a
burst's order sets its TTFTs (its short prompts' 14 ms or 110 ms, queued
behind the long ones or not), the p50 among them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.offload_vs_recompute import MAX_MODEL_LEN
from bench.replay.report import failures
from bench.replay.runs import Endpoint, run_once
from kvstash.common.tokenizer import BYTE_EOS_ID, tokenizer_files
from kvstash.launch.stack import StackConfig, running_stack
from kvstash.workload.flags import max_context
from kvstash.workload.metrics import Slo, summarize
from kvstash.workload.prompts import build_prompts
from kvstash.workload.trace import Trace, fit, read_trace, write_trace

BURST_SPACING_S = 0.01
TOKENIZER_REPO = "kvstash/tiny"
SNAPSHOT = "0" * 40


def spaced(trace: Trace) -> Trace:
    """`trace` with the k-th of the requests that arrive at one time
    BURST_SPACING_S * k later: one order, the trace's, for both tools."""
    requests, last, k = [], None, 0
    for r in trace.requests:
        k = k + 1 if r.arrival_s == last else 0
        last = r.arrival_s
        requests.append(dataclasses.replace(r, arrival_s=r.arrival_s + k * BURST_SPACING_S))
    return Trace(tuple(sorted(requests, key=lambda r: r.arrival_s)), trace.block_tokens)


def offer_tokenizer(hf_home: Path) -> None:
    """The tiny model's tokenizer as a cached Hugging Face repo under hf_home."""
    repo = hf_home / "hub" / f"models--{TOKENIZER_REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    for name, text in tokenizer_files("", "", (BYTE_EOS_ID,)).items():
        (snapshot / name).write_text(text)


def ours(config: StackConfig, trace: Trace) -> dict[str, float]:
    with running_stack(config) as stack:
        assert stack.gateway is not None
        endpoint = Endpoint(stack.address, None, stack.gateway.url, config.model)
        run = asyncio.run(run_once(endpoint, "replay", trace, build_prompts(trace)))
    if failed := failures([run]):  # its figures would be of the rest only
        raise RuntimeError(f"the replayer's round: {failed[0]}")
    s = summarize(run.records, Slo(1e9, 1e9))
    return {"ttft_ms": 1000 * s.ttft_s["p50"], "tpot_ms": 1000 * s.tpot_s["p50"],
            "itl_ms": 1000 * s.itl_s["p50"], "e2e_ms": 1000 * s.e2e_s["p50"],
            "requests_per_s": s.requests_per_s, "output_tokens_per_s": s.output_tokens_per_s}


def theirs(config: StackConfig, aiperf: str, workdir: Path, slice_file: Path,
           block: int) -> dict[str, float]:
    out = workdir / "aiperf"
    shutil.rmtree(out, ignore_errors=True)  # a round reads only its own results
    with running_stack(config) as stack:
        assert stack.gateway is not None
        command = [
            aiperf, "profile", "--model", config.model, "--url", stack.gateway.url,
            "--endpoint-type", "completions", "--streaming", "--input-file", str(slice_file),
            "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
            "--prompt-input-tokens-block-size", str(block), "--tokenizer", TOKENIZER_REPO,
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
            "--random-seed", "0", "--ui-type", "none", "--artifact-dir", str(out)]
        env = os.environ | {"HF_HOME": str(workdir / "hf"), "HF_HUB_OFFLINE": "1"}
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    d = json.loads((out / "profile_export_aiperf.json").read_text())
    return {"ttft_ms": d["time_to_first_token"]["p50"],
            "tpot_ms": d["inter_token_latency"]["p50"],
            "itl_ms": d["inter_chunk_latency"]["p50"], "e2e_ms": d["request_latency"]["p50"],
            "requests_per_s": d["request_throughput"]["avg"],
            "output_tokens_per_s": d["output_token_throughput"]["avg"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replay.aiperf_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", required=True, help="the aiperf executable")
    p.add_argument("--trace", type=Path,
                   default=Path("../shared/traces/mooncake_conversation.jsonl"))
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--count", type=int, default=40)
    p.add_argument("--length-scale", type=float, default=0.0625)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    config = StackConfig(gateway=True)
    try:
        raw = read_trace(args.trace, args.start, args.count)
        longest = max_context(args, MAX_MODEL_LEN["tiny"], config.num_blocks * config.block_size)
        trace = spaced(fit(raw, args.length_scale, rate=args.rate, max_context=longest)[0])
    except (ValueError, OSError) as exc:  # TraceError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows: dict[str, list[dict[str, float]]] = {"replayer": [], "aiperf": []}
    with tempfile.TemporaryDirectory(prefix="kvstash-aiperf-") as tmp:
        workdir = Path(tmp)
        offer_tokenizer(workdir / "hf")
        write_trace(trace, workdir / "slice.jsonl")
        try:
            for _ in range(args.rounds):  # alternating, so drift hits both
                rows["replayer"].append(ours(config, trace))
                rows["aiperf"].append(theirs(config, args.aiperf, workdir,
                                             workdir / "slice.jsonl", trace.block_tokens))
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(f"{len(trace.requests)} requests, {trace.rate:.3g}/s, tiny model through smg; "
          f"medians of {args.rounds} rounds (p50s per round)")
    names = list(rows["replayer"][0])
    print(f"{'':22s}{'replayer':>10s}{'aiperf':>10s}{'ratio':>8s}")
    for name in names:
        a = statistics.median(r[name] for r in rows["replayer"])
        b = statistics.median(r[name] for r in rows["aiperf"])
        print(f"{name:22s}{a:10.2f}{b:10.2f}{b / a:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
