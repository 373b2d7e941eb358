"""Offload + restore vs recompute of one request's KV, side by side, by context length.

For each context length L, on a real worker and a real cache service, both
started here (the worker on the CPU unless --device; the built-in tiny model,
or `--model llama-small`, a random-weight float32 Llama whose max_model_len is
4096, written by bench.worker_bench, or a checkpoint directory):

    recompute          prefill L tokens again in chunks of --chunk tokens (the
                       scheduler's max_num_batched_tokens), each chunk in a step
                       with --decodes running decodes, as a preempted request
                       is recomputed on a busy worker: what the chunks add to
                       those steps (each timed against the decodes alone, just
                       before and after), which is what the cost model predicts
                       (--decodes 0: the chunks' own steps, whole)
    offload + restore  copy L's blocks into the cache service and back into
                       other blocks: command to answer, as the engine times a copy
                       (through the cache's shared-memory arena; --no-arena: gRPC)

Every step and copy also goes into the scheduler's own cost model
(scheduler_svc/core/costs.py), which is then asked, for each L, what it
predicts and which way AUTO preemption would go; the table says whether that
is the side measured faster. Figures are medians over the repeats. Lengths
beyond the model's max_model_len are skipped (the tiny model's is 1024).
Run: python -m bench.offload_vs_recompute [--quick] [--model llama-small] [--lengths 64,1024]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstash.common import rpc_connections
from kvstash.common.sampling import SamplingParams
from kvstash.common.wire import layout_from_proto
from kvstash.launch.processes import Service, start_service
from kvstash.launch.stack import SHARED_MEMORY_DIR
from kvstash.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.core.costs import CostModel
from scheduler_svc.core.outputs import OffloadCommand, RestoreCommand, SchedulerOutput
from scheduler_svc.core.seq import ScheduledSeq
from scheduler_svc.worker_link import StepStream, WorkerLink

# 1k-16k as asked of the benchmark, and shorter ones: the tiny model's
# crossover lies below 1k (and its max_model_len is 1024).
LENGTHS = "16,32,64,128,256,512,1024,2048,4096,8192,16384"
QUICK_LENGTHS = "16,64,256,1024"
MAX_MODEL_LEN = {"tiny": 1024, "llama-small": 4096}
SAMPLING = SamplingParams(1)


@dataclass(slots=True)
class Row:
    num_tokens: int
    num_blocks: int
    # One entry per repeat, in seconds.
    recompute_s: list[float] = field(default_factory=list)
    offload_s: list[float] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)

    @property
    def copy_s(self) -> float:
        return statistics.median(o + r for o, r in zip(self.offload_s, self.restore_s,
                                                       strict=True))

    @property
    def prefill_s(self) -> float:
        return statistics.median(self.recompute_s)


class Bench:
    def __init__(self, stream: StepStream, link: WorkerLink, block_size: int,
                 args: argparse.Namespace, costs: CostModel, first_free_block: int) -> None:
        self.stream = stream
        self.link = link
        self.block_size = block_size
        self.chunk = args.chunk
        self.costs = costs
        self.step_id = 0
        self.num_snapshots = 0
        # The running decodes, each in its own blocks after first_free_block.
        context = args.decode_context
        per_seq = context // block_size + 1
        self.decodes = [
            ScheduledSeq(f"decode{i}", [1], context,
                         list(range(first_free_block + i * per_seq,
                                    first_free_block + (i + 1) * per_seq)), True, SAMPLING)
            for i in range(args.decodes)]

    async def start(self) -> None:
        """Prefills the running decodes' contexts."""
        for seq in self.decodes:
            tokens = [(i * 17 + 3) % 256 for i in range(seq.start_pos)]
            await self.run([ScheduledSeq(seq.request_id, tokens, 0, seq.block_ids, False,
                                         SAMPLING)], 0, False)

    async def step(self, prefill: list[ScheduledSeq], learn: bool) -> float:
        """A step of the running decodes and `prefill`; its wall time."""
        return await self.run([*self.decodes, *prefill], len(self.decodes), learn)

    async def run(self, seqs: list[ScheduledSeq], num_decodes: int, learn: bool) -> float:
        self.step_id += 1
        output = SchedulerOutput(self.step_id, seqs=seqs, num_decodes=num_decodes)
        started = time.monotonic()
        await self.stream.step(output)
        seconds = time.monotonic() - started
        if learn:
            self.costs.observe_step(output.seqs, output.num_decodes, seconds)
        return seconds

    async def recompute(self, tokens: list[int], block_ids: list[int], learn: bool) -> float:
        """Prefills `tokens` from position 0 in chunks; the seconds they add."""
        total = 0.0
        for start in range(0, len(tokens), self.chunk):
            end = min(start + self.chunk, len(tokens))
            chunk = ScheduledSeq("victim", tokens[start:end], start, block_ids,
                                 end == len(tokens), SAMPLING)
            if not self.decodes:
                total += await self.step([chunk], learn)
                continue
            before = await self.step([], learn)
            with_chunk = await self.step([chunk], learn)
            after = await self.step([], learn)
            total += with_chunk - (before + after) / 2
        return total

    async def copy(self, num_tokens: int, source: list[int], target: list[int], learn: bool
                   ) -> tuple[float, float]:
        """Offloads `source` into a snapshot and restores it into `target`."""
        self.num_snapshots += 1
        snapshot_id = f"bench.{self.num_snapshots}"
        offload = OffloadCommand("victim", snapshot_id, source, num_tokens)
        started = time.monotonic()
        outcome = await self.link.offload(offload, 60.0)
        offload_s = time.monotonic() - started
        if outcome.num_bytes is None:
            raise RuntimeError(f"offload failed: {outcome.error}")
        started = time.monotonic()
        outcome = await self.link.restore(RestoreCommand("victim", snapshot_id, target), 60.0)
        restore_s = time.monotonic() - started
        if outcome.num_bytes is None:
            raise RuntimeError(f"restore failed: {outcome.error}")
        if learn:
            self.costs.observe_offload(len(source), offload_s)
            self.costs.observe_restore(len(target), restore_s)
        return offload_s, restore_s

    async def measure(self, row: Row, learn: bool = True) -> None:
        """One more recompute and one more offload + restore of row's length."""
        num_blocks = row.num_blocks
        source, target = list(range(num_blocks)), list(range(num_blocks, 2 * num_blocks))
        tokens = [(i * 131 + 7) % 256 for i in range(row.num_tokens)]
        row.recompute_s.append(await self.recompute(tokens, source, learn))
        offload_s, restore_s = await self.copy(row.num_tokens, source, target, learn)
        row.offload_s.append(offload_s)
        row.restore_s.append(restore_s)


async def run(worker: Service, args: argparse.Namespace, lengths: list[int]) -> dict[str, object]:
    """Measures every length; returns the figures --json writes."""
    channel = rpc_connections.insecure_channel(worker.address)
    try:
        info = await worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(),
                                                                 timeout=60)
        layout = layout_from_proto(info.kv_layout)
        setup = {"model": info.model_name, "device": info.device, "dtype": layout.dtype,
                 "block_size": layout.block_size, **{k: getattr(args, k) for k in (
                     "chunk", "decodes", "decode_context", "arena", "repeat")}}
        kept = sorted(n for n in lengths if n <= info.max_model_len)
        skipped = [n for n in lengths if n > info.max_model_len]
        if not kept:
            raise SystemExit(f"every length is beyond max_model_len {info.max_model_len}")
        print(f"{info.model_name} on {info.device}, {layout.dtype}, "
              f"{layout.bytes_per_block / 1024:.0f} KiB per block of {layout.block_size} tokens; "
              f"prefill chunks of {args.chunk} tokens beside {args.decodes} decodes at "
              f"{args.decode_context} tokens; copies "
              f"{'through the arena' if args.arena else 'over gRPC'}; median of {args.repeat}")
        if skipped:
            print(f"max_model_len is {info.max_model_len}: lengths {skipped} skipped")
        link = WorkerLink(channel)
        stream = await link.open()
        try:
            costs = CostModel(layout.block_size, min_samples=4)
            rows = [Row(n, -(-n // layout.block_size)) for n in kept]
            bench = Bench(stream, link, layout.block_size, args, costs,
                          2 * rows[-1].num_blocks)
            await bench.start()
            for row in rows:  # warm-up: a step shape's first run is slow
                await bench.measure(Row(row.num_tokens, row.num_blocks), learn=False)
            # Round after round over all lengths: a burst of load elsewhere on
            # the machine then spoils one round, not every repeat of one length.
            for _ in range(args.repeat):
                for row in rows:
                    await bench.measure(row)
        finally:
            stream.cancel()
    finally:
        await channel.close()
    return {**setup, "rows": report(rows, costs)}


def report(rows: list[Row], costs: CostModel) -> list[dict[str, object]]:
    """Prints the table; returns its rows (seconds)."""
    print(f"{'tokens':>7} {'blocks':>6} {'offload ms':>10} {'restore ms':>10} "
          f"{'off+res ms':>10} {'recompute ms':>12} {'recomp/copy':>11} {'faster':>9} "
          f"{'model off+res':>13} {'model recomp':>12} {'AUTO picks':>10} {'right':>5}")
    figures: list[dict[str, object]] = []
    for r in rows:
        faster = "offload" if r.copy_s < r.prefill_s else "recompute"
        copy_s, recompute_s = costs.offload_restore_s(r.num_blocks), costs.recompute_s(r.num_tokens)
        # No estimate yet: AUTO offloads.
        pick = ("recompute" if copy_s is not None and recompute_s is not None
                and recompute_s <= copy_s else "offload")
        offload_s, restore_s = statistics.median(r.offload_s), statistics.median(r.restore_s)
        print(f"{r.num_tokens:>7} {r.num_blocks:>6} {offload_s * 1e3:>10.1f} "
              f"{restore_s * 1e3:>10.1f} {r.copy_s * 1e3:>10.1f} {r.prefill_s * 1e3:>12.1f} "
              f"{r.prefill_s / r.copy_s:>11.2f} {faster:>9} {fmt_ms(copy_s, ''):>13} "
              f"{fmt_ms(recompute_s, ''):>12} {pick:>10} {'yes' if pick == faster else 'NO':>5}")
        figures.append({"tokens": r.num_tokens, "blocks": r.num_blocks, "offload_s": offload_s,
                        "restore_s": restore_s, "copy_s": r.copy_s, "recompute_s": r.prefill_s,
                        "faster": faster, "predicted_copy_s": copy_s,
                        "predicted_recompute_s": recompute_s, "auto_picks": pick})
    print(f"measured crossover: {measured_crossover(rows)}")
    e = costs.estimates()
    crossover = ("unknown" if e.crossover_tokens is None
                 else f"{e.crossover_tokens:.0f} tokens")
    print(f"cost model: offload {fmt_ms(e.offload_s_fixed)} + {fmt_ms(e.offload_s_per_block)}"
          f"/block, restore {fmt_ms(e.restore_s_fixed)} + {fmt_ms(e.restore_s_per_block)}/block, "
          f"prefill {fmt_ms(e.prefill_s_per_token)}/token + {fmt_ms(e.prefill_s_per_token_squared)}"
          f"/token^2; offload predicted cheaper above {crossover}")
    return figures


def fmt_ms(seconds: float | None, unit: str = " ms") -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3g}{unit}"


def measured_crossover(rows: list[Row]) -> str:
    """Where the faster side changes between measured lengths."""
    flips = [f"between {a.num_tokens} and {b.num_tokens} tokens"
             for a, b in itertools.pairwise(rows)
             if (a.copy_s < a.prefill_s) != (b.copy_s < b.prefill_s)]
    if flips:
        return "; ".join(flips)
    side = "offload + restore" if rows[0].copy_s < rows[0].prefill_s else "recompute"
    return (f"none in {rows[0].num_tokens}-{rows[-1].num_tokens} tokens: {side} is faster "
            "at every length measured")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=None, help=f"tokens, comma-separated ({LENGTHS})")
    parser.add_argument("--quick", action="store_true",
                        help=f"lengths {QUICK_LENGTHS} (unless --lengths), 3 repeats")
    parser.add_argument("--repeat", type=int, default=None, help="measurements per length (5)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    parser.add_argument("--decodes", type=int, default=8,
                        help="decodes running beside each prefill chunk")
    parser.add_argument("--decode-context", type=int, default=128,
                        help="their positions")
    parser.add_argument("--model", default="tiny",
                        help="tiny, llama-small or a checkpoint directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--arena", action=argparse.BooleanOptionalAction, default=True,
                        help="the cache keeps its memory tier in /dev/shm, which the worker "
                             "maps (the co-located path); --no-arena streams over gRPC")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the figures here (seconds)")
    args = parser.parse_args(argv)
    args.repeat = args.repeat or (3 if args.quick else 5)
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: no directory {args.json.parent} to write it in")
    lengths = [int(n) for n in (args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS))
               .split(",")]
    # KV blocks for the longest length the model takes, twice (the restore
    # fills other blocks), and for the running decodes.
    longest = min(max(lengths), MAX_MODEL_LEN.get(args.model, max(lengths)))
    num_blocks = 2 * -(-longest // 16) + args.decodes * (args.decode_context // 16 + 1)
    with tempfile.TemporaryDirectory(prefix="kvstash-bench-") as workdir:
        logs, model = Path(workdir), args.model
        if model == "llama-small":
            from bench.worker_bench import write_checkpoint  # imports torch

            model = str(logs / model)
            write_checkpoint(Path(model), args.model, "float32")
        arena = ["--arena-dir", SHARED_MEMORY_DIR] if args.arena else []
        cache = start_service("cache", "cache_svc", [
            "--listen", "127.0.0.1:0", "--memory-budget", "2GiB", *arena], logs)
        try:
            worker = start_service("worker", "gpu_worker", [
                "--listen", "127.0.0.1:0", "--model", model, "--device", args.device,
                "--num-blocks", str(num_blocks), "--cache-address", cache.address], logs)
            try:
                figures = asyncio.run(run(worker, args, lengths))
            finally:
                worker.stop()
        finally:
            cache.stop()
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
