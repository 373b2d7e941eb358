"""The command-line flags that choose a workload, shared by the trace replayer
(python -m bench.replay) and the simulator (kvstash sim): a trace slice or a
synthetic trace, scaled to fit, at one or more request rates."""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from kvstash.workload.trace import TRACE_BLOCK_TOKENS, Trace, fit, read_trace, synthetic


def add_flags(p: argparse.ArgumentParser) -> argparse._MutuallyExclusiveGroup:
    """The workload flags; returns the group of sources (--trace, --synthetic),
    one of which must be given, where a caller may add its own source."""
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="a Mooncake-format JSONL trace")
    p.add_argument("--block-tokens", type=int, default=TRACE_BLOCK_TOKENS,
                   help="tokens a hash id of --trace stands for (Mooncake's; a slice "
                        "--write-trace wrote says its own)")
    source.add_argument("--synthetic", type=int, metavar="N",
                        help="N synthetic requests: Poisson arrivals at --rates' first rate")
    p.add_argument("--synthetic-input", type=int, default=256,
                   help="mean prompt tokens after the shared blocks")
    p.add_argument("--synthetic-output", type=int, default=32, help="mean output tokens")
    p.add_argument("--synthetic-shared-blocks", type=int, default=1,
                   help="blocks (of 512 tokens x --length-scale) every prompt opens with")
    p.add_argument("--start", type=int, default=0, help="first request of the slice")
    p.add_argument("--count", type=int, help="requests in the slice (default: all)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="prompt and output lengths times this")
    p.add_argument("--output-scale", type=float,
                   help="output lengths times this instead (default: --length-scale)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="gaps between arrivals times this (without --rates)")
    p.add_argument("--rates", help="comma-separated mean request rates to run the slice at")
    p.add_argument("--max-context", type=int,
                   help="drop requests (prompt + output) longer than this (default: the "
                        "longest an instance serves: max_model_len, or the tokens its KV pool "
                        "holds where fewer)")
    p.add_argument("--seed", type=int, default=0)
    return source


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits through `p.error` on a bad value; turns --rates into a list
    ([None]: the slice's own arrival times)."""
    for name in ("count", "synthetic", "max_context", "block_tokens"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.synthetic is not None and (args.start or args.count is not None):
        p.error("--start and --count cut a --trace; --synthetic N makes N requests")
    for name in ("length_scale", "output_scale", "time_scale"):
        if getattr(args, name) is not None and not 0 < getattr(args, name) < math.inf:
            p.error(f"--{name.replace('_', '-')} must be finite and > 0")
    try:
        args.rates = [float(r) for r in args.rates.split(",")] if args.rates else [None]
    except ValueError:
        p.error(f"--rates must be comma-separated numbers, got {args.rates!r}")
    if any(r is not None and not 0 < r < math.inf for r in args.rates):
        p.error("--rates must be finite and > 0")


def load_slice(args: argparse.Namespace) -> Trace:
    """The trace slice, or the synthetic trace, before fitting (TraceError,
    OSError on a bad file)."""
    if args.trace is not None:
        return read_trace(args.trace, args.start, args.count, args.block_tokens)
    return synthetic(args.synthetic, args.rates[0] or 1.0, args.synthetic_input,
                     args.synthetic_output, args.synthetic_shared_blocks, args.seed)


def max_context(args: argparse.Namespace, max_model_len: int | None,
                pool_tokens: int | None) -> int | None:
    """The longest request (prompt + output) a slice keeps: --max-context, by
    default the longest an instance serves: `max_model_len`, or fewer where
    its KV pool holds fewer (`pool_tokens`; None where either is not known).
    The scheduler refuses a longer request at admission, so it would only
    fail: a --max-context beyond what an instance serves is a ValueError."""
    known = [n for n in (max_model_len, pool_tokens) if n is not None]
    longest = min(known) if known else None
    if args.max_context is None:
        return longest
    if longest is not None and args.max_context > longest:
        raise ValueError(f"--max-context {args.max_context} is more than an instance serves: "
                         f"{longest} tokens (max_model_len {max_model_len}, a KV pool of "
                         f"{pool_tokens} tokens); longer requests would be refused")
    return args.max_context


def fit_slices(args: argparse.Namespace, raw: Trace, max_context: int | None
               ) -> list[tuple[Trace, int]]:
    """The slice fitted for each of --rates, and how many requests each
    dropped as longer than `max_context` (ValueError, TraceError where it
    cannot be fitted)."""
    return [fit(raw, args.length_scale, args.time_scale, rate, max_context, args.output_scale)
            for rate in args.rates]


def probe_writable(directory: Path) -> None:
    """OSError where no file can be made in `directory` (read-only, not ours,
    /proc): found before a run, not when its results are written after it."""
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvstash-probe-"):
        pass
