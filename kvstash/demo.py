"""`kvstash demo`: the main job on the embedded defaults.

Starts the three services with a KV pool far smaller than the workload needs,
sends every request at once (so decode requests get preempted, offloaded to
the cache service and restored), streams one of them, then replays each
request alone (an unpressured run) and checks the outputs are identical.
With `--pd`, requests are prefilled on one instance and decoded on another;
the pressure (and the preemptions) is on the decode instance.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

from kvstash.cache_client import CacheClient
from kvstash.client import Client, GenerateResult
from kvstash.stack import StackConfig, running_stack
from kvstash.units import MIB

WORDS = ("kv", "cache", "block", "decode", "prefill", "stash", "token", "batch", "resume")


def make_prompts(num_requests: int) -> list[str]:
    """Deterministic prompts of varied length (16 to ~120 bytes)."""
    prompts = []
    for i in range(num_requests):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + (i * 5) % 20)]
        prompts.append(f"request {i}: " + " ".join(words))
    return prompts


@dataclass(slots=True)
class Timed:
    result: GenerateResult
    seconds: float


async def _one(client: Client, prompt: str, max_tokens: int, echo: bool) -> Timed:
    start = time.perf_counter()
    result = GenerateResult(request_id="")
    async for delta in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True):
        result.token_ids.extend(delta.token_ids)
        result.text += delta.text
        if echo and delta.text:
            print(delta.text.encode("ascii", "replace").decode(), end="", flush=True)
        if delta.finish_reason is not None:
            result.finish_reason, result.usage = delta.finish_reason, delta.usage
    return Timed(result, time.perf_counter() - start)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _run(address: str, cache_address: str, num_requests: int, max_tokens: int,
               decode_address: str | None = None) -> bool:
    prompts = make_prompts(num_requests)
    async with Client(address) as client:
        print(f"-- {num_requests} concurrent requests, {max_tokens} tokens each; "
              "streaming request 0 (random tiny model, so the text is noise):")
        start = time.perf_counter()
        pressured = await asyncio.gather(*[
            _one(client, p, max_tokens, echo=(i == 0)) for i, p in enumerate(prompts)])
        wall = time.perf_counter() - start
        stats = handoff = await client.stats()
        if decode_address is not None:  # preemptions happen on the decode instance
            async with Client(decode_address) as decode:
                stats = await decode.stats()
        print("\n-- replaying each request alone (unpressured) to check outputs ...")
        alone = [await _one(client, p, max_tokens, echo=False) for p in prompts]
    async with CacheClient(cache_address) as cache:
        cache_stats = await cache.stats()

    num_tokens = sum(len(t.result.token_ids) for t in pressured)
    ttfts = [t.result.usage.ttft_s for t in pressured if t.result.usage is not None]
    matched = sum(a.result.token_ids == b.result.token_ids
                  for a, b in zip(pressured, alone, strict=True))
    rows = [
        ("requests", f"{num_requests}"),
        ("completion tokens", f"{num_tokens}"),
        ("wall time", f"{wall:.2f} s"),
        ("throughput", f"{num_tokens / wall:.1f} tokens/s"),
        ("TTFT p50 / p99", f"{_pct(ttfts, 0.5) * 1000:.0f} / {_pct(ttfts, 0.99) * 1000:.0f} ms"),
        ("KV pool", f"{stats.num_total_blocks} blocks of {stats.block_size} tokens"),
        ("preemptions offload / recompute",
         f"{stats.num_preemptions_offload} / {stats.num_preemptions_recompute}"),
        ("offloaded / restored", f"{stats.bytes_offloaded / MIB:.1f} / "
                                 f"{stats.bytes_restored / MIB:.1f} MiB"),
        ("tokens recomputed", f"{stats.num_recomputed_tokens}"),
        *([("P/D handoffs", f"{handoff.num_handoffs} ({handoff.bytes_handed_off / MIB:.1f} MiB), "
                            f"{handoff.num_handoff_failures} failed")]
          if decode_address is not None else []),
        ("snapshots left in cache", f"{cache_stats.memory_snapshots + cache_stats.disk_snapshots}"),
        ("outputs equal to unpressured run", f"{matched}/{num_requests}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return matched == num_requests


def run_demo(config: StackConfig, num_requests: int, max_tokens: int) -> int:
    instances = "a prefill and a decode instance" if config.pd else "scheduler"
    print(f"starting cache, worker ({config.model}, {config.dtype}) and {instances} "
          f"with {config.num_blocks} KV blocks ...", flush=True)
    with running_stack(config) as stack:
        decode = stack.decode_scheduler
        ok = asyncio.run(_run(stack.address, stack.cache.address, num_requests, max_tokens,
                              None if decode is None else decode.address))
    if not ok:
        print("outputs differ from the unpressured run", file=sys.stderr)
    return 0 if ok else 1
