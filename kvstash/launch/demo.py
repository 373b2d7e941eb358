"""`kvstash demo`: the main job on the embedded defaults.

Starts the three services with a KV pool far smaller than the workload needs,
sends every request at once (so decode requests get preempted, offloaded to
the cache service and restored), streams one of them, then replays each
request alone (an unpressured run) and checks the outputs are identical.
With `--pd`, requests are prefilled on one instance and decoded on another;
the pressure (and the preemptions) is on the decode instance. With
`--gateway`, the requests are OpenAI HTTP streams through smg, which routes
them over the `--instances`; their text is checked against the replays.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.client import Client
from kvstash.common.units import MIB
from kvstash.launch.openai_http import REPLACEMENT, request_json, stream_completion
from kvstash.launch.stack import Stack, StackConfig, start_stack, worker_threads
from kvstash.v1 import scheduler_pb2

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WORDS = ("kv", "cache", "block", "decode", "prefill", "stash", "token", "batch", "resume")


def make_prompts(num_requests: int) -> list[str]:
    """Deterministic prompts of varied length (16 to ~120 bytes)."""
    prompts = []
    for i in range(num_requests):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + (i * 5) % 20)]
        prompts.append(f"request {i}: " + " ".join(words))
    return prompts


@dataclass(frozen=True, slots=True)
class Outcome:
    # What the replay must equal: the token ids (kvstash's API), or the text
    # without an undecodable tail (through the gateway, which sends text only).
    output: tuple[int, ...] | str
    num_tokens: int
    ttft_s: float | None


def _echo(text: str) -> None:
    print(text.encode("ascii", "replace").decode(), end="", flush=True)


async def _direct(client: Client, prompt: str, max_tokens: int, echo: bool,
                  as_text: bool = False) -> Outcome:
    token_ids: list[int] = []
    text = ""
    ttft = None
    async for delta in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True):
        token_ids.extend(delta.token_ids)
        text += delta.text
        if echo:
            _echo(delta.text)
        if delta.usage is not None:
            ttft = delta.usage.ttft_s
    output = text.rstrip(REPLACEMENT) if as_text else tuple(token_ids)
    return Outcome(output, len(token_ids), ttft)


async def _http(url: str, model: str, prompt: str, max_tokens: int, echo: bool) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    done = await stream_completion(url, body, _echo if echo else None)
    ttft = done.arrivals[0] - done.start if done.arrivals else None
    return Outcome(done.text.rstrip(REPLACEMENT), done.completion_tokens, ttft)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _stats(addresses: list[str]) -> list[scheduler_pb2.SchedulerStats]:
    replies = []
    for address in addresses:
        async with Client(address) as client:
            replies.append(await client.stats())
    return replies


def _total(stats: list[scheduler_pb2.SchedulerStats], name: str) -> int:
    return sum(getattr(s, name) for s in stats)


async def _run(stack: Stack, num_requests: int, max_tokens: int) -> bool:
    prompts = make_prompts(num_requests)
    gateway = stack.gateway
    via = f"through smg at {gateway.url}" if gateway else "over kvstash's gRPC API"
    print(f"-- {num_requests} concurrent requests {via}, {max_tokens} tokens each; "
          "streaming request 0 (random tiny model, so the text is noise):")
    start = time.perf_counter()
    if gateway is None:
        async with Client(stack.address) as client:
            pressured = await asyncio.gather(*[
                _direct(client, p, max_tokens, echo=(i == 0)) for i, p in enumerate(prompts)])
    else:
        model = str((await asyncio.to_thread(request_json, f"{gateway.url}/v1/models"))
                    ["data"][0]["id"])
        pressured = await asyncio.gather(*[
            _http(gateway.url, model, p, max_tokens, echo=(i == 0))
            for i, p in enumerate(prompts)])
    wall = time.perf_counter() - start
    front = await _stats(stack.addresses)
    # Preemptions happen where requests decode: on the decode instance with pd.
    decoding = front if stack.decode_scheduler is None else await _stats(
        [stack.decode_scheduler.address])
    print("\n-- replaying each request alone (unpressured) to check outputs ...")
    async with Client(stack.address) as client:
        alone = [await _direct(client, p, max_tokens, echo=False, as_text=gateway is not None)
                 for p in prompts]
    async with CacheClient(stack.cache.address) as cache:
        cache_stats = await cache.stats()

    num_tokens = sum(o.num_tokens for o in pressured)
    ttfts = [o.ttft_s for o in pressured if o.ttft_s is not None]
    matched = sum(a.output == b.output for a, b in zip(pressured, alone, strict=True))
    first = decoding[0]
    rows = [
        ("requests", f"{num_requests}"),
        *([("requests per instance", " / ".join(str(s.num_finished) for s in front))]
          if len(front) > 1 else []),
        ("completion tokens", f"{num_tokens}"),
        ("wall time", f"{wall:.2f} s"),
        ("throughput", f"{num_tokens / wall:.1f} tokens/s"),
        ("TTFT p50 / p99" + (" (client, first text)" if gateway else ""),
         f"{_pct(ttfts, 0.5) * 1000:.0f} / {_pct(ttfts, 0.99) * 1000:.0f} ms" if ttfts else "-"),
        ("KV pool", f"{first.num_total_blocks} blocks of {first.block_size} tokens"
                    + (f", on each of {len(decoding)} instances" if len(decoding) > 1 else "")),
        ("preemptions offload / recompute", f"{_total(decoding, 'num_preemptions_offload')} / "
                                            f"{_total(decoding, 'num_preemptions_recompute')}"),
        ("offloaded / restored", f"{_total(decoding, 'bytes_offloaded') / MIB:.1f} / "
                                 f"{_total(decoding, 'bytes_restored') / MIB:.1f} MiB"),
        ("tokens recomputed", f"{_total(decoding, 'num_recomputed_tokens')}"),
        *([("P/D handoffs", f"{_total(front, 'num_handoffs')} "
                            f"({_total(front, 'bytes_handed_off') / MIB:.1f} MiB), "
                            f"{_total(front, 'num_handoff_failures')} failed")]
          if stack.decode_scheduler is not None else []),
        ("snapshots left in cache", f"{cache_stats.memory_snapshots + cache_stats.disk_snapshots}"),
        ("outputs equal to unpressured run" + (" (text)" if gateway else ""),
         f"{matched}/{num_requests}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return matched == num_requests


def _run_held(stack: Stack, num_requests: int, max_tokens: int) -> bool:
    """`_run`, cancelled by a stop signal, which then acts (kvstash demo's
    handler raises, to stop the stack) once the event loop has closed, as it
    would have at once outside it. Raised inside the loop, a handler's
    exception lands in whatever callback is running, grpc's included (a
    segfault, seen), and the services outlive the demo. Cancelled: False."""
    came: list[int] = []
    main: list[asyncio.Task[bool]] = []

    def hold(signum: int, _frame: object) -> None:
        came.append(signum)
        if main:  # as asyncio.Runner does on SIGINT
            main[0].get_loop().call_soon_threadsafe(main[0].cancel)

    async def run() -> bool:
        main.append(asyncio.current_task())  # type: ignore[arg-type]
        return await _run(stack, num_requests, max_tokens)

    handlers = {sig: signal.signal(sig, hold) for sig in STOP_SIGNALS}
    try:
        return asyncio.run(run())
    except asyncio.CancelledError:
        if not came:
            raise
        return False
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if came:
            signal.raise_signal(came[0])


def run_demo(config: StackConfig, num_requests: int, max_tokens: int,
             stop: Callable[[Stack], None] = Stack.stop) -> int:
    """`stop` stops the stack however the run ends (kvstash demo's keeps a
    second stop signal from cutting that short)."""
    each = f"worker ({config.model}, {config.dtype}) and {'prefill ' if config.pd else ''}scheduler"
    front = each if config.instances == 1 else f"{config.instances} instances of {each}"
    decode = ", a decode instance" if config.pd else ""
    gateway = ", smg in front" if config.gateway else ""
    threads = worker_threads(config)[0]
    print(f"starting cache, {front}{decode}{gateway}, {config.num_blocks} KV blocks and "
          f"{threads} torch threads each ...", flush=True)
    stack = start_stack(config)
    try:
        ok = _run_held(stack, num_requests, max_tokens)
    finally:
        stop(stack)
    if not ok:
        print("outputs differ from the unpressured run", file=sys.stderr)
    return 0 if ok else 1
