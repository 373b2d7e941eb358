"""A request's KV out to the cache service and back, by the worker's own code,
against the raw copy of the same blocks (D2H + H2D through pinned memory on
CUDA, two memcpys on CPU), side by side.

    python -m bench.kv_transfer_bench [--shapes tiny,1b,8b] [--tokens 1024,8192]
                                      [--device auto] [--rounds 3] [--json PATH]

Each round, per shape and context length, moves the blocks of `tokens`
tokens three ways and checks every copy landed:

  raw      ModelRunner.gather_blocks_into a pooled host buffer, then
           scatter_blocks into other blocks: the floor;
  arena    KvTransfer.offload + restore through a real cache process that
           keeps its memory tier in /dev/shm, which this process maps (the
           co-located path: gather straight into the extent, hash, commit;
           verify, scatter);
  grpc     the same, streamed over gRPC (CacheClient(use_arena=False)), as
           a worker on another host would.

Shapes are the KV layouts of real models (a small random model with that
many layers and KV heads; the weights do not matter here): tiny (the built-in
model), 1b (Llama-3.2-1B: 16 layers, 8 KV heads of 64, 32 KiB per token in
bf16) and 8b (Llama-3.1-8B: 32 layers, 8 KV heads of 128, 128 KiB per token).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.cache_bench import start_cache
from gpu_worker.config import tiny_model_config
from gpu_worker.model import build_tiny_model
from gpu_worker.runner import ModelRunner
from gpu_worker.transfer import KvTransfer
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common.units import MIB
from kvstash.launch.stack import SHARED_MEMORY_DIR

BLOCK_SIZE = 16
# name: (layers, kv heads, head dim, dtype); the query heads equal the KV heads.
SHAPES = {
    "tiny": (4, 2, 32, torch.float32),
    "1b": (16, 8, 64, torch.bfloat16),
    "8b": (32, 8, 128, torch.bfloat16),
}
PATHS = ("raw", "arena", "grpc")


def kv_runner(shape: str, num_blocks: int, device: torch.device) -> ModelRunner:
    layers, heads, dim, dtype = SHAPES[shape]
    cfg = dataclasses.replace(tiny_model_config(), num_layers=layers, num_heads=heads,
                              num_kv_heads=heads, head_dim=dim, hidden_size=heads * dim,
                              intermediate_size=64)
    model = build_tiny_model(cfg, seed=0, dtype=dtype, device=device)
    runner = ModelRunner(model, block_size=BLOCK_SIZE, num_blocks=num_blocks,
                         host_pool_bytes=num_blocks * MIB * 64)
    runner.kv_cache.normal_()
    return runner


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def one_round(runner: ModelRunner, transfers: dict[str, KvTransfer],
                    compute: ThreadPoolExecutor, tokens: int, name: str) -> dict[str, float]:
    n = -(-tokens // BLOCK_SIZE)
    src, dst = list(range(n)), list(range(n, 2 * n))
    loop = asyncio.get_running_loop()
    seconds: dict[str, float] = {}

    def raw() -> None:
        with runner.host_pool.lend(n) as host:
            runner.gather_blocks_into(src, host)
            runner.scatter_blocks(dst, host)
        sync(runner.device)

    for path in PATHS:
        runner.kv_cache[:, :, dst] = 0
        sync(runner.device)
        started = time.perf_counter()
        if path == "raw":
            await loop.run_in_executor(compute, raw)
        else:
            deadline = loop.time() + 600
            await transfers[path].offload(f"{name}-{path}", src, tokens, deadline)
            await transfers[path].restore(f"{name}-{path}", dst, deadline)
            await loop.run_in_executor(compute, sync, runner.device)
        seconds[path] = time.perf_counter() - started
        if not torch.equal(runner.kv_cache[:, :, dst], runner.kv_cache[:, :, src]):
            raise AssertionError(f"{path}: the blocks came back different")
    return seconds


async def run(address: str, args: argparse.Namespace,
              device: torch.device) -> list[dict[str, object]]:
    """Prints a row per shape and length; returns them (seconds) for --json."""
    print(f"{device.type}, median of {args.rounds} rounds; ratio = raw copy time / path time "
          "in the same round (1.0 = as fast as the raw copy)")
    print(f"{'shape':<6}{'tokens':>7}{'MiB':>8}" + "".join(f"{p + ' ms':>10}" for p in PATHS)
          + f"{'arena ratio':>13}{'grpc ratio':>12}")
    figures: list[dict[str, object]] = []
    clients = {"arena": CacheClient(address, timeout_s=600),
               "grpc": CacheClient(address, timeout_s=600, use_arena=False)}
    try:
        for shape in args.shapes:
            runner = kv_runner(shape, 2 * -(-max(args.tokens) // BLOCK_SIZE), device)
            with ThreadPoolExecutor(1) as compute:
                transfers = {p: KvTransfer(runner, compute, c) for p, c in clients.items()}
                for tokens in args.tokens:
                    rounds = [await one_round(runner, transfers, compute, tokens,
                                              f"{shape}-{tokens}-{i}")
                              for i in range(args.rounds + 1)][1:]  # the first warms up
                    mib = -(-tokens // BLOCK_SIZE) * runner.host_pool.block_bytes / MIB
                    med = {p: statistics.median(r[p] for r in rounds) for p in PATHS}
                    ratio = {p: statistics.median(r["raw"] / r[p] for r in rounds)
                             for p in ("arena", "grpc")}
                    print(f"{shape:<6}{tokens:>7}{mib:>8.0f}"
                          + "".join(f"{med[p] * 1e3:>10.1f}" for p in PATHS)
                          + f"{ratio['arena']:>13.2f}{ratio['grpc']:>12.2f}", flush=True)
                    figures.append({"device": device.type, "shape": shape, "tokens": tokens,
                                    "mib": mib, **{f"{p}_s": med[p] for p in PATHS},
                                    **{f"{p}_ratio": ratio[p] for p in ratio}})
            del runner, transfers
    finally:
        for client in clients.values():
            await client.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_transfer_bench")
    parser.add_argument("--shapes", default=None, type=lambda t: t.split(","),
                        help="default: tiny,1b,8b on CUDA; tiny,1b on CPU (8b's gathers "
                             "take seconds there)")
    parser.add_argument("--tokens", default="1024,8192",
                        type=lambda t: [int(x) for x in t.split(",")])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the figures here (seconds; ratio = raw / path)")
    args = parser.parse_args(argv)
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: no directory {args.json.parent} to write it in")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    args.shapes = args.shapes or (list(SHAPES) if device.type == "cuda" else ["tiny", "1b"])
    if unknown := set(args.shapes) - SHAPES.keys():
        parser.error(f"unknown shapes {sorted(unknown)}; choose from {sorted(SHAPES)}")
    largest = max(args.tokens) * max(SHAPES[s][0] * SHAPES[s][1] * SHAPES[s][2] * 4
                                     for s in args.shapes)  # K and V, up to 2 bytes each
    proc, address = start_cache(largest + 64 * MIB, ["--arena-dir", SHARED_MEMORY_DIR])
    try:
        figures = asyncio.run(run(address, args, device))
    finally:
        proc.terminate()
        proc.wait(30)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
