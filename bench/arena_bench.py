"""The co-located path against memcpy and against gRPC streaming, side by side.

    python -m bench.arena_bench [--sizes 256MiB,1GiB] [--rounds 5]

Starts one `python -m cache_svc` with its memory tier in a shared-memory
arena (/dev/shm). Each round, for each size, puts and gets one snapshot
three ways, one right after the other:

  memcpy   copies of the same bytes into a warm buffer of the same size and
           back, in the client's chunks over as many threads as its arena
           path copies on: the floor, what the bytes cost to move at all;
  arena    CacheClient through the arena (cache.proto PutShared/GetShared:
           copy into the extent, hash it, commit; verify, copy out);
  grpc     CacheClient streaming the same bytes to the same server
           (PutSnapshot/GetSnapshot), as a worker on another host would.

Ratios are memcpy time / path time within a round (machine noise hits all
sides alike); the table prints their medians and the median MiB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.cache_bench import start_cache, vm_kib
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.cache_sdk.chunk_codec import DEFAULT_CHUNK_BYTES
from kvstash.cache_sdk.shared_arena import COPY_THREADS, copy_bytes
from kvstash.common.layout import Layout
from kvstash.common.malloc_tuning import tune_malloc
from kvstash.common.units import MIB, parse_bytes
from kvstash.launch.stack import SHARED_MEMORY_DIR

PATHS = ("memcpy", "arena", "grpc")
LAYOUT = Layout(num_layers=1, block_size=1, num_kv_heads=1, head_dim=MIB // 4,
                dtype="float16")  # 1 MiB blocks


_floor_threads = ThreadPoolExecutor(COPY_THREADS)


def parallel_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src in the cache client's chunks, over as many threads as its
    arena path copies on (not hashing): the floor a copy on every core it
    uses could reach. One thread's memcpy flattered the arena path."""
    d, s, step = dst.data.cast("B"), src.data.cast("B"), DEFAULT_CHUNK_BYTES
    list(_floor_threads.map(lambda start: copy_bytes(d[start:start + step],
                                                     s[start:start + step]),
                            range(0, d.nbytes, step)))


def memcpy_round(data: np.ndarray, scratch: np.ndarray, out: np.ndarray) -> tuple[float, float]:
    started = time.perf_counter()
    parallel_copy(scratch, data)
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    parallel_copy(out, scratch)
    return put_s, time.perf_counter() - started


async def cache_round(client: CacheClient, name: str, data: np.ndarray,
                      out: np.ndarray) -> tuple[float, float]:
    num_blocks = data.nbytes // MIB
    started = time.perf_counter()
    await client.put(name, LAYOUT, num_blocks, num_blocks, data)
    put_s = time.perf_counter() - started
    out[:] = 0
    started = time.perf_counter()
    await client.get_into(name, out.data, consume=True)
    get_s = time.perf_counter() - started
    if not np.array_equal(out, data):
        raise AssertionError(f"{name} came back different")
    return put_s, get_s


async def run(address: str, sizes: list[int], rounds: int) -> dict[int, dict[str, list]]:
    shared = CacheClient(address, timeout_s=600)
    streamed = CacheClient(address, timeout_s=600, use_arena=False)
    if await shared.arena() is None:
        raise SystemExit("the cache's arena cannot be mapped here")
    results: dict[int, dict[str, list]] = {}
    try:
        for size in sizes:
            data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            scratch, out = np.ones_like(data), np.ones_like(data)  # faulted in
            times: dict[str, list] = {path: [] for path in PATHS}
            for i in range(rounds + 1):  # round 0 warms up (mappings, pools)
                memcpy = memcpy_round(data, scratch, out)
                arena = await cache_round(shared, f"a{size}-{i}", data, out)
                grpc = await cache_round(streamed, f"g{size}-{i}", data, out)
                if i:
                    for path, t in zip(PATHS, (memcpy, arena, grpc), strict=True):
                        times[path].append(t)
            results[size] = times
    finally:
        await shared.close()
        await streamed.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.arena_bench")
    parser.add_argument("--sizes", default="256MiB,1GiB",
                        type=lambda text: [parse_bytes(s) // MIB * MIB for s in text.split(",")])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    tune_malloc()
    budget = max(args.sizes) + 64 * MIB
    proc, address = start_cache(budget, ["--arena-dir", SHARED_MEMORY_DIR])
    try:
        results = asyncio.run(run(address, args.sizes, args.rounds))
        peak_kib = vm_kib(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        proc.wait(30)
    med = statistics.median
    print(f"{os.cpu_count()} CPUs, median of {args.rounds} rounds; ratio = memcpy time / "
          "path time in the same round (1.0 = as fast as memcpy)")
    print(f"{'size':<10}{'path':<8}{'put MiB/s':>11}{'get MiB/s':>11}"
          f"{'put ratio':>11}{'get ratio':>11}")
    for size, times in results.items():
        mib = size / MIB
        for path in PATHS:
            put_ratio = med(m[0] / t[0] for m, t in zip(times["memcpy"], times[path],
                                                        strict=True))
            get_ratio = med(m[1] / t[1] for m, t in zip(times["memcpy"], times[path],
                                                        strict=True))
            print(f"{f'{mib:.0f} MiB':<10}{path:<8}{med(mib / t[0] for t in times[path]):>11.0f}"
                  f"{med(mib / t[1] for t in times[path]):>11.0f}"
                  f"{put_ratio:>11.2f}{get_ratio:>11.2f}")
    print(f"cache server peak RSS {peak_kib / 1024:.0f} MiB (arena = memory budget "
          f"{budget / MIB:.0f} MiB, shared with clients)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
