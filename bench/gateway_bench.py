"""Through smg (OpenAI HTTP) vs kvstash's own gRPC API: one stack, side by side.

    python -m bench.gateway_bench [--requests 16] [--max-tokens 32] [--rounds 12]
                                  [--model tiny|DIR] [--device auto] [--json FILE]

Starts one stack (cache, worker, scheduler) and the Shepherd Model Gateway
(smg, `pip install kvstash[gateway]`) in front of its scheduler:

    direct:  this process --Generate (gRPC)----------------> scheduler
    smg:     this process --POST /v1/completions--> smg --> scheduler (VllmEngine)

Each round sends the same N streaming requests (text prompts of
--min/--max-prompt-chars random ASCII, greedy, ignore_eos, max_tokens each)
at once through one path, then through the other; rounds alternate which
goes first (ABBA), so a burst of load elsewhere on the machine hits both.
Before each path's turn the scheduler's prefix cache is flushed (VllmEngine
FlushCache), so the second path never reuses the first's prompts; the
prefix-hit counter over the measured rounds is printed to show it. Every
round has prompts of its own; a first round on each path, on other prompts,
warms up and is not counted.

Per request, on the client (both paths in this one asyncio loop: one gRPC
channel; one HTTP/1.1 connection per request, asyncio streams, no library):
  TTFT  the call to the first message with output: a delta with token ids
        (direct), an SSE chunk with non-empty text (smg). smg's detokenizer
        holds back bytes that make no character yet, so where the first
        token has no text of its own (the tiny model emits raw bytes) smg
        shows it with a later token. So TTFT and TPOT count only the requests
        whose first token has text (known from the direct output of the same
        prompt), the same requests on both paths; "TTFT, all requests" shows
        what the held-back tokens add.
  TPOT  (the finishing message's arrival - the first's) / (tokens - 1), with
        the completion's token count: direct, the token ids received; smg,
        usage.completion_tokens of its last chunk ("stream_options":
        {"include_usage": true}, which smg 1.13 honours for completions).
p50 and p99 by nearest rank, pooled over the rounds; the ratio is smg /
direct; requests/s = requests / the wall time of their rounds. The two
paths' outputs must agree, request by request (smg's text = the direct
path's, both without an undecodable tail): exit status 1 if not, or if a
request fails or ends short.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import string
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from bench.load_test import Percentiles, percentiles
from bench.pd_bench import conclude, fmt, ratio, require_positive
from kvstash import errors
from kvstash.client import Client
from kvstash.common import rpc_connections
from kvstash.launch.gateway import running_gateway
from kvstash.launch.openai_http import (
    REPLACEMENT,
    HttpError,
    StreamError,
    request_json,
    stream_completion,
)
from kvstash.launch.stack import StackConfig, running_stack

PATHS = ("direct", "smg")
ALPHABET = string.ascii_letters + string.digits + " "


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the client saw it; times in seconds."""

    # U+FFFD stripped from the end: smg holds an undecodable tail back for good
    text: str
    num_tokens: int
    finish_reason: str | None
    ttft_s: float | None  # None: no output
    tpot_s: float | None  # None below two tokens
    # Direct only: the first token's text is empty or undecodable, which smg
    # holds back until a character completes (its TTFT is then a later token's).
    first_text_late: bool = False


@dataclass(slots=True)
class Side:
    samples: list[Sample] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)  # per round

    def pct_ms(self, name: str, only: list[bool] | None = None) -> Percentiles | None:
        """Of field `name`, over the samples `only` marks (all by default)."""
        values = [getattr(s, name) for i, s in enumerate(self.samples) if only is None or only[i]]
        return percentiles([v * 1e3 for v in values if v is not None])


def make_prompts(seed: int, args: argparse.Namespace) -> list[str]:
    prompts = []
    for i in range(args.requests):
        rng = random.Random(seed * 1_000_003 + i)
        length = rng.randint(args.min_prompt_chars, args.max_prompt_chars)
        prompts.append("".join(rng.choice(ALPHABET) for _ in range(length)))
    return prompts


def timed(start: float, first: float | None, end: float | None, num_tokens: int
          ) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) from the arrivals of the first and the finishing message."""
    ttft = None if first is None else first - start
    if first is None or end is None or num_tokens < 2:
        return ttft, None
    return ttft, (end - first) / (num_tokens - 1)


async def direct_request(client: Client, prompt: str, max_tokens: int) -> Sample:
    start = time.perf_counter()
    texts: list[str] = []  # per delta with tokens
    num_tokens = 0
    first = end = None
    finish_reason = None
    try:
        async for delta in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True,
                                           timeout_s=600):
            now = time.perf_counter()
            if delta.token_ids:
                first = first or now
                texts.append(delta.text)
            num_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                finish_reason, end = delta.finish_reason, now
    except errors.KvstashError as exc:
        finish_reason = f"error {exc}"
    return Sample("".join(texts).rstrip(REPLACEMENT), num_tokens, finish_reason,
                  *timed(start, first, end, num_tokens),
                  first_text_late=bool(texts) and not texts[0].strip(REPLACEMENT))


async def smg_request(url: str, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    try:
        done = await stream_completion(url, body)
    except (OSError, HttpError, StreamError, ValueError, asyncio.IncompleteReadError) as exc:
        return Sample("", 0, f"error {exc}", None, None)
    first = done.arrivals[0] if done.arrivals else None
    return Sample(done.text.rstrip(REPLACEMENT), done.completion_tokens, done.finish_reason,
                  *timed(done.start, first, done.finished_at, done.completion_tokens))


async def run_round(path: str, client: Client, url: str, model: str, prompts: list[str],
                    max_tokens: int, side: Side | None) -> None:
    """Every prompt at once through `path`; recorded in `side` unless None."""
    start = time.perf_counter()
    if path == "direct":
        calls = [direct_request(client, p, max_tokens) for p in prompts]
    else:
        calls = [smg_request(url, model, p, max_tokens) for p in prompts]
    samples = await asyncio.gather(*calls)
    if side is not None:
        side.wall_s.append(time.perf_counter() - start)
        side.samples += samples


async def flush(engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    """Empties the scheduler's prefix cache: the next path starts as cold as
    the last one did."""
    reply = await engine.FlushCache(common_pb2.FlushCacheRequest())
    assert reply.success, reply.message


async def measure(address: str, url: str, model: str, args: argparse.Namespace
                  ) -> tuple[dict[str, Side], int]:
    """The warm-up, then the rounds. Returns the sides and the prefix-cache
    hits (tokens) over the measured rounds."""
    async with Client(address) as client, rpc_connections.insecure_channel(address) as channel:
        engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        for path in PATHS:
            await flush(engine)
            await run_round(path, client, url, model, make_prompts(-1, args), args.max_tokens,
                            None)
        hits_before = (await client.stats()).num_prefix_hit_tokens
        sides = {path: Side() for path in PATHS}
        for r in range(args.rounds):
            prompts = make_prompts(r, args)
            for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                await flush(engine)
                await run_round(path, client, url, model, prompts, args.max_tokens, sides[path])
            print(f"round {r + 1}/{args.rounds}: direct {sides['direct'].wall_s[-1]:.1f} s, "
                  f"smg {sides['smg'].wall_s[-1]:.1f} s", flush=True)
        hits = (await client.stats()).num_prefix_hit_tokens - hits_before
    return sides, hits


def report(sides: dict[str, Side], num_hit_tokens: int, args: argparse.Namespace
           ) -> tuple[list[str], dict[str, object]]:
    """The printed lines, and the same figures for --json."""
    lines = [f"{'':<28}{'direct':>10}{'smg':>10}{'smg / direct':>14}"]
    figures: dict[str, object] = {}
    # Requests whose first token has text of its own: there both paths time
    # the same tokens (the same prompts, so the same requests on both).
    at_once = [not s.first_text_late for s in sides["direct"].samples]
    rows = (("TTFT", "ttft_s", "ttft", at_once), ("TPOT", "tpot_s", "tpot", at_once),
            ("TTFT, all requests", "ttft_s", "ttft_all", None))
    for label, name, key, only in rows:
        d, s = (sides[p].pct_ms(name, only) for p in PATHS)
        for q in ("p50", "p99"):
            dv, sv = (None if x is None else getattr(x, q) for x in (d, s))
            lines.append(f"{label + ' ' + q + ' ms':<28}{fmt(dv):>10}{fmt(sv):>10}"
                         f"{ratio(sv, dv):>14}")
            figures[f"{key}_{q}_ms"] = {"direct": dv, "smg": sv}
    rps = {p: len(sides[p].samples) / sum(sides[p].wall_s) for p in PATHS}
    lines.append(f"{'requests/s':<28}{rps['direct']:>10.2f}{rps['smg']:>10.2f}"
                 f"{ratio(rps['smg'], rps['direct']):>14}")
    num_requests = args.requests * args.rounds
    lines += ["", f"{num_requests} requests per path; TTFT and TPOT over the "
              f"{sum(at_once)} whose first token has text of its own (the others' smg shows "
              f"with a later token); prefix-cache hits over the measured rounds: "
              f"{num_hit_tokens} tokens"]
    figures.update(requests_per_s=rps, num_requests=num_requests,
                   num_shown_at_once=sum(at_once), num_prefix_hit_tokens=num_hit_tokens,
                   wall_s={p: sides[p].wall_s for p in PATHS})
    return lines, figures


def check_samples(sides: dict[str, Side], max_tokens: int) -> list[str]:
    problems = []
    for path in PATHS:
        short = [s for s in sides[path].samples
                 if s.finish_reason != "length" or s.num_tokens != max_tokens]
        if short:
            problems.append(f"{path}: {len(short)} requests did not end with {max_tokens} "
                            f"tokens (e.g. {short[0].num_tokens}, {short[0].finish_reason})")
    differ = [i for i, (d, s) in enumerate(zip(sides["direct"].samples, sides["smg"].samples,
                                               strict=True)) if d.text != s.text]
    if differ:
        problems.append(f"{len(differ)} requests' text differs between direct and smg "
                        f"(request indexes: {differ[:8]})")
    return problems


def served_model(url: str) -> str:
    return str(request_json(f"{url}/v1/models")["data"][0]["id"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="concurrent, per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-prompt-chars", type=int, default=16)
    parser.add_argument("--max-prompt-chars", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=12,
                        help="measured rounds per path, after one warm-up round each")
    parser.add_argument("--model", default="tiny", help="tiny or a checkpoint directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--worker-threads", type=int, default=1,
                        help="torch threads of the worker; 0 = torch's default (one per core)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    require_positive(parser, args, "requests", "max_tokens", "min_prompt_chars", "rounds")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2: TPOT needs two tokens")
    if args.max_prompt_chars < args.min_prompt_chars:
        parser.error(f"--max-prompt-chars {args.max_prompt_chars} < --min-prompt-chars "
                     f"{args.min_prompt_chars}")
    config = StackConfig(model=args.model, device=args.device, dtype=args.dtype,
                         worker_args=("--num-threads", str(args.worker_threads)))
    print(f"{args.requests} concurrent requests per round, prompts {args.min_prompt_chars}-"
          f"{args.max_prompt_chars} chars, {args.max_tokens} output tokens, greedy; "
          f"{args.model} on {args.device}, torch threads: {args.worker_threads}; "
          f"1 warm-up + {args.rounds} rounds per path, alternating ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvstash-gateway-bench-") as logs, \
            running_stack(config) as stack, \
            running_gateway([stack.address], Path(logs)) as gateway:
        model = served_model(gateway.url)
        sides, hits = asyncio.run(measure(stack.address, gateway.url, model, args))
    lines, figures = report(sides, hits, args)
    return conclude(lines, figures, check_samples(sides, args.max_tokens),
                    f"outputs: all {args.requests * args.rounds} requests' text identical "
                    f"through both paths, every one {args.max_tokens} tokens", args.json, "ok")


if __name__ == "__main__":
    sys.exit(main())
