"""Request traces in the Mooncake format, and how a run fits one to this machine.

One JSON object a line (Mooncake's FAST'25 traces; aiperf, guidellm and
Dynamo read the same format):

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

timestamp: arrival in milliseconds from the trace's start; hash_ids: one id a
512-token block of the prompt, so requests sharing a leading run of ids share
that prefix. `fit` takes a slice and scales it: lengths by one factor (the
block with them, so shared prefixes stay shared), arrivals by another.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # tokens a hash id stands for in the Mooncake traces


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # from the first request's arrival
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]  # one a block of block_tokens prompt tokens


@dataclass(frozen=True, slots=True)
class Trace:
    requests: tuple[TraceRequest, ...]  # in arrival order
    block_tokens: int = TRACE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if not self.requests:
            raise TraceError("the trace holds no requests")
        if self.block_tokens <= 0:
            raise TraceError(f"block_tokens must be > 0, got {self.block_tokens}")

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def rate(self) -> float:
        """Mean arrivals per second (inf when they all arrive at once)."""
        span = self.duration_s
        return (len(self.requests) - 1) / span if span > 0 else math.inf


def parse_line(text: str, where: str, block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRequest:
    """One line of a trace whose hash ids stand for `block_tokens` tokens each;
    TraceError naming `where` and what is wrong."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected an object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids")
               if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    stamp, inputs, outputs, ids = (obj["timestamp"], obj["input_length"],
                                   obj["output_length"], obj["hash_ids"])
    ms = math.nan
    if isinstance(stamp, int | float) and not isinstance(stamp, bool):
        try:
            ms = float(stamp)
        except OverflowError:  # an integer past any float
            ms = math.inf
    if not 0 <= ms < math.inf:
        raise TraceError(f"{where}: timestamp must be a finite number of ms >= 0, got "
                         f"{repr(stamp)[:40]}")
    for name, value in (("input_length", inputs), ("output_length", outputs)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TraceError(f"{where}: {name} must be an integer > 0, got {value!r}")
    if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    if len(ids) * block_tokens < inputs:
        raise TraceError(f"{where}: {len(ids)} hash_ids cover {len(ids) * block_tokens} "
                         f"tokens, fewer than input_length {inputs}")
    return TraceRequest(ms / 1000.0, inputs, outputs, tuple(ids))


def read_trace(path: Path, start: int = 0, count: int | None = None,
               block_tokens: int = TRACE_BLOCK_TOKENS) -> Trace:
    """Requests start .. start+count-1 (0-based, blank lines skipped) of a
    JSONL trace whose hash ids stand for `block_tokens` tokens each (a slice
    `write_trace` wrote: its fitted block), arrivals from the first of them;
    every line up to the last taken is checked."""
    if start < 0 or (count is not None and count <= 0) or block_tokens <= 0:
        raise ValueError(f"need start >= 0, count > 0 and block_tokens > 0, got {start}, "
                         f"{count}, {block_tokens}")
    requests: list[TraceRequest] = []
    index = 0
    last = 0.0
    with path.open("rb") as lines:  # decoded a line at a time, so a bad byte names its line
        for number, raw in enumerate(lines, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(f"{path.name}:{number}: not UTF-8 (byte "
                                 f"{raw[exc.start]:#04x} at column {exc.start + 1})") from None
            if not text.strip():
                continue
            request = parse_line(text, f"{path.name}:{number}", block_tokens)
            if request.arrival_s < last:
                raise TraceError(f"{path.name}:{number}: timestamps go back ({last * 1000:g} "
                                 f"ms, then {request.arrival_s * 1000:g} ms)")
            last = request.arrival_s
            if index >= start:
                requests.append(request)
            index += 1
            if count is not None and len(requests) == count:
                break
    if not requests:
        raise TraceError(f"{path.name}: no requests from #{start} ({index} in the file)")
    first = requests[0].arrival_s
    return Trace(tuple(TraceRequest(r.arrival_s - first, r.input_length, r.output_length,
                                    r.hash_ids) for r in requests), block_tokens)


def fit(trace: Trace, length_scale: float = 1.0, time_scale: float = 1.0,
        rate: float | None = None, max_context: int | None = None,
        output_scale: float | None = None) -> tuple[Trace, int]:
    """The trace scaled to fit a run, and how many requests were dropped.

    Lengths (and the block a hash id stands for) are multiplied by
    `length_scale`, rounded, at least 1 token (outputs by `output_scale`
    where given, to keep more of the decode work); gaps between arrivals by
    `time_scale`, or, with `rate`, by what makes the mean rate of the
    requests kept `rate` per second (the pattern kept), arrivals from the
    first kept. Requests whose scaled prompt + output exceed `max_context`
    are dropped (a clipped one would change the prefix structure and the
    work)."""
    output_scale = length_scale if output_scale is None else output_scale
    factors = (length_scale, time_scale, output_scale, 1.0 if rate is None else rate)
    if not all(0 < x < math.inf for x in factors):  # NaN fails both
        raise ValueError(f"scales and rate must be finite and > 0, got length_scale="
                         f"{length_scale}, "
                         f"output_scale={output_scale}, time_scale={time_scale}, rate={rate}")
    block = max(1, round(trace.block_tokens * length_scale))
    kept = []
    for r in trace.requests:
        inputs = min(max(1, round(r.input_length * length_scale)), block * len(r.hash_ids))
        outputs = max(1, round(r.output_length * output_scale))
        if max_context is None or inputs + outputs <= max_context:
            ids = r.hash_ids[:-(-inputs // block)]  # rounding may leave an id unused
            kept.append(TraceRequest(r.arrival_s, inputs, outputs, ids))
    if not kept:
        raise TraceError(f"no request fits max_context={max_context} at length_scale "
                         f"{length_scale}")
    # The rate is the kept requests' own: the dropped would thin it out.
    unscaled = Trace(tuple(kept), block)
    if rate is not None:
        if not math.isfinite(unscaled.rate):
            raise ValueError("every request kept arrives at once: a rate cannot scale the "
                             "arrivals")
        time_scale = unscaled.rate / rate
    first = kept[0].arrival_s
    scaled = tuple(TraceRequest((r.arrival_s - first) * time_scale, r.input_length,
                                r.output_length, r.hash_ids) for r in kept)
    return Trace(scaled, block), len(trace.requests) - len(kept)


def synthetic(num_requests: int, rate: float, input_mean: int, output_mean: int,
              shared_blocks: int = 0, seed: int = 0,
              block_tokens: int = TRACE_BLOCK_TOKENS) -> Trace:
    """Poisson arrivals at `rate`/s; every prompt opens with the same
    `shared_blocks` blocks (a system prompt), then its own tokens, log-normal
    around `input_mean` (sigma 0.5), as are the outputs around `output_mean`."""
    if min(num_requests, input_mean, output_mean, block_tokens) <= 0 or rate <= 0 \
            or shared_blocks < 0:
        raise ValueError("num_requests, rate, means and block_tokens must be > 0, "
                         "shared_blocks >= 0")
    rng = random.Random(seed)

    def draw(mean: int) -> int:
        sigma = 0.5
        return max(1, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)))

    requests, now, next_id = [], 0.0, shared_blocks
    for _ in range(num_requests):
        inputs = shared_blocks * block_tokens + draw(input_mean)
        own = math.ceil(inputs / block_tokens) - shared_blocks
        ids = (*range(shared_blocks), *range(next_id, next_id + own))
        next_id += own
        requests.append(TraceRequest(now, inputs, draw(output_mean), ids))
        now += rng.expovariate(rate)
    return Trace(tuple(requests), block_tokens)


def jittered(trace: Trace, seconds: float, seed: int) -> Trace:
    """The trace with each arrival later by up to `seconds` (uniform, seeded),
    in the order that makes: the lag a real client adds when it sends, which
    also decides which of the requests a burst sends at once comes first. A
    served run's latency percentiles on a short slice hang on that order
    (which request a long prefill step lands beside), so one exact run is
    one draw of them; runs of several jittered copies show their spread."""
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(f"jitter must be >= 0 s, got {seconds}")
    rng = random.Random(seed)
    late = [TraceRequest(r.arrival_s + rng.uniform(0.0, seconds), r.input_length,
                         r.output_length, r.hash_ids) for r in trace.requests]
    return Trace(tuple(sorted(late, key=lambda r: r.arrival_s)), trace.block_tokens)


def jittered_runs(trace: Trace, runs: int, seconds: float) -> list[Trace]:
    """`runs` traces to serve: `trace` as it is, then jittered copies (seeds 1, 2, ...)."""
    return [trace, *(jittered(trace, seconds, seed) for seed in range(1, runs))]


def write_trace(trace: Trace, path: Path) -> None:
    """In the Mooncake format, as fitted: a tool replaying it must be told
    the block a hash id stands for (`trace.block_tokens`; read_trace's
    block_tokens, --block-tokens here; aiperf: --prompt-input-tokens-block-size)."""
    lines = (json.dumps({"timestamp": round(r.arrival_s * 1000, 3),
                         "input_length": r.input_length, "output_length": r.output_length,
                         "hash_ids": list(r.hash_ids)}) for r in trace.requests)
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
