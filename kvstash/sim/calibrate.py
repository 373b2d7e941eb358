"""`kvstash calibrate`: measure a cost profile (profile.py) on this machine.

It starts a real cache service and a real worker (the model given, on the
device given), drives them as the engine does (scheduler_svc.worker_link),
and fits the profile's lines by least squares:

    steps   decodes, prefill chunks and both together, of several sizes and
            contexts: fixed + per prefill token + per decode row + per key
    arena   offload + restore of 4..256 blocks through the shared-memory arena
    grpc    the same, with a cache that has no arena (a remote cache)
    disk    the cache's own disk-tier files (cache_svc.disk): write + read

Each measure is the median of --repeat after a warm-up; copy costs are the
mean of an offload and a restore (the profile has one line per path). The
profile records the command, the machine, the date and each fit's error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from kvstash.common import rpc_connections
from kvstash.common.layout import Layout
from kvstash.common.sampling import SamplingParams
from kvstash.common.units import MIB, parse_counts
from kvstash.common.wire import layout_from_proto
from kvstash.launch.data_dir import DataDir
from kvstash.launch.processes import Service, start_service
from kvstash.launch.stack import SHARED_MEMORY_DIR, StackConfig, worker_threads
from kvstash.sim.profile import (
    DEFAULT_PROFILE,
    CopyCost,
    CostProfile,
    StepCost,
    lstsq,
    read_profile,
)
from kvstash.sim.replay import read_record, replay
from kvstash.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.core.costs import step_features
from scheduler_svc.core.outputs import OffloadCommand, RestoreCommand, SchedulerOutput
from scheduler_svc.core.seq import ScheduledSeq
from scheduler_svc.worker_link import StepStream, WorkerLink

SAMPLE = SamplingParams(1)
COPY_BLOCKS = (4, 16, 64, 256)
DECODE_BATCHES = (1, 8, 32, 64)
PREFILL_CHUNKS = (64, 256, 512)
MIXED_DECODES = 32
# A worker's layout, its steps (fit rows, seconds) and copies (bytes, seconds).
Measured = tuple[Layout, list[tuple[list[float], float]], list[tuple[int, float]]]


def step_shapes(max_context: int, chunks: tuple[int, ...] = PREFILL_CHUNKS
                ) -> list[tuple[int, int, int, int]]:
    """(decodes, decode context, prefill tokens, prefill start) of each step measured."""
    contexts = (128, max_context // 2)
    shapes = [(b, c, 0, 0) for b in DECODE_BATCHES for c in contexts]
    shapes += [(0, 0, n, s) for n in chunks for s in (0, max_context // 2)]
    shapes += [(MIXED_DECODES, c, 512, 0) for c in contexts]
    return shapes


class Driver:
    """Steps and copies on one worker, as the engine sends them."""

    def __init__(self, link: WorkerLink, stream: StepStream, layout: Layout) -> None:
        self.link, self.stream, self.block_size = link, stream, layout.block_size
        self.step_id = self.copies = 0

    def seqs(self, decodes: int, context: int, prefill: int, start: int) -> list[ScheduledSeq]:
        per_decode = context // self.block_size + 1
        out = [ScheduledSeq(f"d{i}", [1], context,
                            list(range(i * per_decode, (i + 1) * per_decode)), True, SAMPLE)
               for i in range(decodes)]
        if prefill:
            first = decodes * per_decode if decodes else 0
            blocks = -(-(start + prefill) // self.block_size)
            out.append(ScheduledSeq("p", [(i * 131 + 7) % 256 for i in range(prefill)], start,
                                    list(range(first, first + blocks)), True, SAMPLE))
        return out

    async def step(self, seqs: list[ScheduledSeq], num_decodes: int) -> float:
        self.step_id += 1
        started = time.perf_counter()
        await self.stream.step(SchedulerOutput(self.step_id, seqs=seqs, num_decodes=num_decodes))
        return time.perf_counter() - started

    async def copy(self, num_blocks: int) -> float:
        """Mean of one offload and one restore of `num_blocks` blocks."""
        self.copies += 1
        snapshot_id = f"calibrate.{self.copies}"
        source, target = list(range(num_blocks)), list(range(num_blocks, 2 * num_blocks))
        started = time.perf_counter()
        done = await self.link.offload(
            OffloadCommand("c", snapshot_id, source, num_blocks * self.block_size), 120.0)
        middle = time.perf_counter()
        if done.num_bytes is not None:
            done = await self.link.restore(RestoreCommand("c", snapshot_id, target), 120.0)
        if done.num_bytes is None:
            raise RuntimeError(f"copy of {num_blocks} blocks failed: {done.error}")
        return (middle - started + time.perf_counter() - middle) / 2


async def median(measure: Callable[[], Awaitable[float]], repeat: int) -> float:
    await measure()  # warm-up: a shape's first run is slow
    return statistics.median([await measure() for _ in range(repeat)])


async def drive(worker: Service, repeat: int, chunks: tuple[int, ...] | None) -> Measured:
    """Steps (prefilling `chunks`, none when None) and copies on a running
    worker: (fit rows and seconds), (bytes and seconds)."""
    channel = rpc_connections.insecure_channel(worker.address)
    try:
        info = await worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(),
                                                                 timeout=60)
        layout = layout_from_proto(info.kv_layout)
        link = WorkerLink(channel)
        stream = await link.open()
        try:
            driver = Driver(link, stream, layout)
            step_rows = []
            for decodes, context, prefill, start in (
                    step_shapes(min(info.max_model_len, 2048), chunks) if chunks else []):
                seqs = driver.seqs(decodes, context, prefill, start)
                seconds = await median(functools.partial(driver.step, seqs, decodes), repeat)
                step_rows.append((list(step_features(seqs, decodes)), seconds))
            copies = [(n * layout.bytes_per_block,
                       await median(functools.partial(driver.copy, n), repeat))
                      for n in COPY_BLOCKS]
        finally:
            stream.cancel()
    finally:
        await channel.close()
    return layout, step_rows, copies


def disk_copies(layout: Layout, repeat: int, directory: Path) -> list[tuple[int, float]]:
    """The cache's disk-tier write and read of snapshots of COPY_BLOCKS blocks."""
    from cache_svc.disk import DiskFiles
    from cache_svc.snapshot import SnapshotMeta

    files = DiskFiles(directory)
    out = []
    for n in COPY_BLOCKS:
        size = n * layout.bytes_per_block
        meta = SnapshotMeta(f"calibrate{n}", layout, n, n * layout.block_size, size, MIB,
                            pinned=True, ttl_s=60)
        payload = memoryview(os.urandom(size))
        times = []
        for _ in range(repeat + 1):
            started = time.perf_counter()
            path = files.write(meta, payload, (0,) * meta.num_chunks)
            assert path is not None  # wanted, as nothing says otherwise
            fd = files.open(path)
            try:
                files.read(fd, 0, size)
            finally:
                os.close(fd)
            times.append((time.perf_counter() - started) / 2)
            files.remove(path)
        out.append((size, statistics.median(times[1:])))
    return out


def fit_copy(samples: list[tuple[int, float]]) -> tuple[CopyCost, float]:
    (fixed, per_byte), error = lstsq([[1.0, float(b)] for b, _ in samples],
                                     [s for _, s in samples])
    return CopyCost(fixed, 1.0 / per_byte if per_byte > 0 else 1e15), error


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run_stack(model: str, device: str, threads: int, repeat: int, logs: Path,
              chunks: tuple[int, ...] | None) -> Measured:
    """A cache and a worker, driven: steps and copies through the cache's
    arena where `chunks` is given, else copies only, over gRPC."""
    cache = start_service("cache", "cache_svc", [
        "--listen", "127.0.0.1:0", "--memory-budget", "4GiB",
        *(["--arena-dir", SHARED_MEMORY_DIR] if chunks else [])], logs)
    try:
        worker = start_service("worker", "gpu_worker", [
            "--listen", "127.0.0.1:0", "--model", model, "--device", device,
            "--num-blocks", "5000", "--num-threads", str(threads),
            "--cache-address", cache.address], logs)
        try:
            return asyncio.run(drive(worker, repeat, chunks))
        finally:
            worker.stop()
    finally:
        cache.stop()


def calibrate(model: str, device: str, threads: int, repeat: int, name: str,
              chunks: tuple[int, ...] = PREFILL_CHUNKS) -> tuple[CostProfile, str]:
    with DataDir() as workdir:  # a killed calibrate's is removed by the next launcher
        logs = Path(workdir)
        layout, steps, arena = run_stack(model, device, threads, repeat, logs, chunks)
        grpc = run_stack(model, device, threads, repeat, logs, None)[2]
        (logs / "disk").mkdir()
        disk = disk_copies(layout, repeat, logs / "disk")
    coef, step_error = lstsq([r for r, _ in steps], [s for _, s in steps])
    lines = [f"{'decodes':>8} {'positions':>10} {'prefill':>8} {'squares':>14} "
             f"{'measured ms':>12} {'fitted ms':>10}"]
    for row, seconds in steps:
        fitted = sum(c * x for c, x in zip(coef, row, strict=True))
        lines.append(f"{row[1]:>8.0f} {row[2]:>10.0f} {row[3]:>8.0f} {row[4]:>14.0f} "
                     f"{seconds * 1e3:>12.2f} {fitted * 1e3:>10.2f}")
    copies = {"arena": fit_copy(arena), "grpc": fit_copy(grpc), "disk": fit_copy(disk)}
    how = (f"kvstash calibrate --model {model} --device {device} --worker-threads {threads} "
           f"--repeat {repeat} --prefill-chunks {','.join(map(str, chunks))}; "
           f"{cpu_name()}, {os.cpu_count()} CPUs, {datetime.date.today().isoformat()}; "
           f"relative RMS error of the fit")
    source = {"step": f"{how} {step_error:.1%}"} | {
        f"copy.{path}": f"{how} {error:.1%}" for path, (_, error) in copies.items()}
    return CostProfile(name, layout.bytes_per_block, layout.block_size, StepCost(*coef),
                       {path: cost for path, (cost, _) in copies.items()}, source), "\n".join(lines)


def from_record(path: Path, base: CostProfile, name: str | None) -> tuple[CostProfile, str]:
    """`base` with its step line fitted to the steps a served run recorded:
    each step's turn of the engine's loop (the worker's step, then the
    scheduler's update, streams and next schedule), with the cache and
    clients beside, where `calibrate` times the worker alone."""
    if not path.is_file():
        raise ValueError(f"--from-record {path}: no such file")
    replayed = replay(read_record(path))
    if replayed.mismatch is not None:  # its steps would not be the steps it ran
        raise ValueError(f"{path} does not replay: {replayed.mismatch}")
    # Each step's whole turn of the loop, the scheduler's own time included.
    steps = [(x, turn) for (x, _), turn in zip(replayed.steps, replayed.turns, strict=False)]
    if len(steps) < 5:
        raise ValueError(f"{path}: {len(steps)} recorded steps; a fit needs at least 5")
    coef, error = lstsq([list(x) for x, _ in steps], [s for _, s in steps])
    how = (f"kvstash calibrate --from-record {path.name}: {len(steps)} served steps (each "
           f"from its schedule() to the next), {datetime.date.today().isoformat()}; "
           f"relative RMS error of the fit {error:.1%}")
    return CostProfile(name or f"{base.name}, steps as served", base.bytes_per_block,
                       base.block_size, StepCost(*coef), base.copy, {**base.source, "step": how}
                       ), f"fitted {len(steps)} recorded steps: relative RMS error {error:.1%}"


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("calibrate", help="measure a cost profile for kvstash sim here",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="where to write the profile (JSON)")
    p.add_argument("--model", default="tiny", help="'tiny' or a checkpoint directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--worker-threads", type=int, default=worker_threads(StackConfig())[0],
                   help="the worker's torch threads (default: what `kvstash up` gives its one "
                        "worker here)")
    p.add_argument("--repeat", type=int, default=3, help="measures per shape (median)")
    p.add_argument("--name", help="the profile's name (default: model and device)")
    p.add_argument("--prefill-chunks", type=parse_counts, default=PREFILL_CHUNKS,
                   help="prefill chunk sizes measured, comma-separated (GPUs: add the long "
                        "chunks a long-prompt workload schedules)")
    p.add_argument("--from-record", type=Path, metavar="RECORD",
                   help="instead of driving a worker: fit the step line to the steps a "
                        "served run recorded (a scheduler's --record-decisions), the other "
                        "processes on its host included; copies from --copies")
    p.add_argument("--copies", type=Path, default=DEFAULT_PROFILE,
                   help="with --from-record: the profile whose copy lines and block size "
                        "to keep")


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1 or args.worker_threads < 1:
        raise ValueError(f"--repeat and --worker-threads must be >= 1, got {args.repeat}, "
                         f"{args.worker_threads}")
    if args.from_record is not None:
        profile, said = from_record(args.from_record, read_profile(args.copies), args.name)
    else:
        profile, said = calibrate(args.model, args.device, args.worker_threads, args.repeat,
                                  args.name or f"{Path(args.model).name} on {args.device}",
                                  args.prefill_chunks)
    try:  # written first: a reader gone (`| head`) fails the printing, not the measuring
        args.out.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    finally:  # printed even where it could not be written
        print(f"{said}\n{json.dumps(profile.to_json(), indent=1)}")
    print(f"wrote {args.out}")
    return 0
