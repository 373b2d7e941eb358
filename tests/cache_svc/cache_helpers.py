"""Shared helpers for the cache tests: layouts, payloads, raw put streams, and
real server processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from cache_svc.disk import CHECKSUM_BYTES, DATA_OFFSET
from cache_svc.model import pages
from kvstash.cache_sdk import chunk_codec
from kvstash.common.layout import Layout
from kvstash.common.units import MIB
from kvstash.common.wire import layout_to_proto
from kvstash.v1 import cache_pb2, cache_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def on_disk(num_snapshots: int, num_bytes: int = 4 * MIB, chunk_bytes: int = MIB) -> int:
    """The disk budget `num_snapshots` of `num_bytes` (put in chunks of
    `chunk_bytes`) take: each its file, head and checksums, in whole pages."""
    chunks = -(-num_bytes // chunk_bytes)
    return num_snapshots * pages(DATA_OFFSET + num_bytes + CHECKSUM_BYTES * chunks)


def make_layout(
    dtype: str = "float16", num_layers: int = 2, block_size: int = 16,
    num_kv_heads: int = 4, head_dim: int = 64,
) -> Layout:
    return Layout(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, dtype=dtype)


def bytes_per_block(layout: Layout) -> int:
    return layout.bytes_per_block


def make_payload(layout: Layout, num_blocks: int, seed: int = 0) -> np.ndarray:
    """A KV tensor of the layout's dtype, as raw bytes. bfloat16 (which numpy
    lacks) is built as the top halves of float32 values, as torch stores it."""
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
             layout.head_dim)
    values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    if layout.dtype == "bfloat16":
        raw = (values.view(np.uint32) >> 16).astype(np.uint16)
    else:
        raw = values.astype(layout.dtype)
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1)


def make_header(
    snapshot_id: str, layout: Layout, num_blocks: int, chunk_bytes: int = MIB,
    pinned: bool = True, ttl_s: int = 0, total_bytes: int | None = None,
) -> cache_pb2.SnapshotHeader:
    return cache_pb2.SnapshotHeader(
        snapshot_id=snapshot_id, layout=layout_to_proto(layout), num_blocks=num_blocks,
        num_tokens=num_blocks * layout.block_size,
        total_bytes=num_blocks * bytes_per_block(layout) if total_bytes is None else total_bytes,
        chunk_bytes=chunk_bytes, checksum_algorithm=cache_pb2.CHECKSUM_ALGORITHM_XXH3_64,
        pinned=pinned, ttl_s=ttl_s,
    )


def chunk_msg(index: int, data: bytes, checksum: int | None = None) -> cache_pb2.PutSnapshotRequest:
    return cache_pb2.PutSnapshotRequest(chunk=cache_pb2.Chunk(
        index=index, data=data,
        checksum=chunk_codec.checksum(data) if checksum is None else checksum,
    ))


async def send(
    stub: cache_pb2_grpc.KVCacheStub, messages: Iterable[cache_pb2.PutSnapshotRequest]
) -> grpc.aio.AioRpcError | None:
    """One raw PutSnapshot of exactly these messages; the error, or None."""

    async def requests() -> AsyncIterator[cache_pb2.PutSnapshotRequest]:
        for message in messages:
            yield message

    try:
        await stub.PutSnapshot(requests(), timeout=60)
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


async def send_without_waiting(
    channel: grpc.aio.Channel, messages: Iterable[bytes], timeout_s: float = 60
) -> grpc.StatusCode:
    """One PutSnapshot of these wire messages (a header, then chunks from
    kvstash.cache_sdk.chunk_codec.encode_chunk), sent the way grpcurl or a client in
    another language may: all at once, never waiting for the server's
    admission metadata. Returns the call's status."""
    put = channel.stream_unary("/kvstash.v1.KVCache/PutSnapshot",
                               request_serializer=bytes,
                               response_deserializer=cache_pb2.PutSnapshotResponse.FromString)

    async def requests() -> AsyncIterator[bytes]:
        for message in messages:
            yield message

    try:
        await put(requests(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def split(data: bytes, chunk_bytes: int) -> list[bytes]:
    return [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)]


@dataclass
class CacheProcess:
    proc: subprocess.Popen[str]
    address: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self, field: str = "VmRSS") -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"{field} not in /proc/{self.pid}/status")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout_s: float = 15) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)


class RssSampler:
    """Samples a process's resident memory every `interval_s` on a thread,
    while used as a context manager; `peak` is the highest sample."""

    def __init__(self, process: CacheProcess, interval_s: float = 0.05) -> None:
        self._process = process
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.peak = 0
        self.num_samples = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.rss_bytes())
            self.num_samples += 1
            self._stop.wait(self._interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def start_cache_process(*args: str, timeout_s: float = 30,
                        log: Path | None = None) -> CacheProcess:
    """Runs `python -m cache_svc --listen 127.0.0.1:0 ARGS` and waits for its
    readiness line. Its log (stderr) is appended to `log` when given."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with contextlib.ExitStack() as files:
        stderr = None if log is None else files.enter_context(log.open("a"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "cache_svc", "--listen", "127.0.0.1:0", "--log-level",
             "warning", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in _lines(proc):
        if line.startswith("KVSTASH_READY cache "):
            return CacheProcess(proc, line.split()[2])
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError(f"cache process exited with {proc.wait()} before it was ready")


def _lines(proc: subprocess.Popen[str]) -> Iterator[str]:
    assert proc.stdout is not None
    yield from proc.stdout


class FakeClock:
    """A clock for SnapshotStore's TTLs that moves only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 30.0
) -> None:
    """Polls `condition` (plain or async) until true. The deadline is generous
    on purpose: it only bounds a hang, it does not time anything."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s} s still not: {what}")
        await asyncio.sleep(0.01)
