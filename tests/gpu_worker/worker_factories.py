"""Factories shared by the worker tests: tiny runners, a minimal greedy loop,
an in-memory cache service, and a real worker process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpu_worker.config import tiny_model_config
from gpu_worker.model import CausalLM, build_tiny_model
from gpu_worker.runner import ModelRunner, SeqWork
from kvstash import errors
from kvstash.common.layout import Layout
from kvstash.common.sampling import GREEDY, SamplingParams
from kvstash.common.wire import layout_to_proto
from kvstash.v1 import cache_pb2

BLOCK_SIZE = 4
REPO = Path(__file__).resolve().parents[2]
_MODELS: dict[torch.dtype, CausalLM] = {}


def tiny_model(dtype: torch.dtype = torch.float32) -> CausalLM:
    """One model per dtype for the whole session: weights are read-only."""
    if dtype not in _MODELS:
        _MODELS[dtype] = build_tiny_model(tiny_model_config(), seed=0, dtype=dtype, device="cpu")
    return _MODELS[dtype]


def make_runner(dtype: torch.dtype = torch.float32, num_blocks: int = 64,
                block_size: int = BLOCK_SIZE, row_tile: int | None = None,
                batch_invariant: bool = True) -> ModelRunner:
    """row_tile None: whole steps (the CPU default); set: tiles of that many rows."""
    return ModelRunner(tiny_model(dtype), block_size=block_size, num_blocks=num_blocks,
                       row_tile=row_tile, batch_invariant=batch_invariant)


def prompt(text: str) -> list[int]:
    return list(text.encode())


def blocks_for(num_tokens: int, first: int = 0, block_size: int = BLOCK_SIZE) -> list[int]:
    return list(range(first, first + -(-num_tokens // block_size)))


def greedy_generate(runner: ModelRunner, prompt_ids: Sequence[int], num_tokens: int,
                    block_ids: Sequence[int], chunk: int | None = None,
                    sampling: SamplingParams = GREEDY) -> list[int]:
    """Prefill (in chunks of `chunk` tokens, or whole), then decode one token a step."""
    chunk = chunk or len(prompt_ids)
    token: int | None = None
    for start in range(0, len(prompt_ids), chunk):
        piece = list(prompt_ids[start:start + chunk])
        last = start + len(piece) == len(prompt_ids)
        [token] = runner.execute([SeqWork("r", piece, start, block_ids, last, sampling)])
    assert token is not None
    out = [token]
    while len(out) < num_tokens:
        pos = len(prompt_ids) + len(out) - 1
        [token] = runner.execute([SeqWork("r", [out[-1]], pos, block_ids, True, sampling)])
        assert token is not None
        out.append(token)
    return out


@dataclass
class MemoryCache:
    """A `gpu_worker.transfer.SnapshotClient` keeping snapshots in a dict, with
    CacheClient's put/get_into contract (a get with `consume` deletes what it
    read). Each call takes `delay_s` (None = forever) and records the deadline
    it was given in `timeouts`."""

    delay_s: float | None = 0.0
    snapshots: dict[str, tuple[cache_pb2.SnapshotHeader, bytes]] = field(default_factory=dict)
    timeouts: list[float | None] = field(default_factory=list)
    closed: bool = False

    async def _wait(self, timeout_s: float | None) -> None:
        self.timeouts.append(timeout_s)
        await asyncio.sleep(3600 if self.delay_s is None else self.delay_s)

    async def put(self, snapshot_id: str, layout: Layout, num_blocks: int,
                  num_tokens: int, data: memoryview, pinned: bool = True, ttl_s: int = 0,
                  timeout_s: float | None = None) -> int:
        await self._wait(timeout_s)
        header = cache_pb2.SnapshotHeader(snapshot_id=snapshot_id, layout=layout_to_proto(layout),
                                          num_blocks=num_blocks, num_tokens=num_tokens,
                                          total_bytes=len(data), pinned=pinned, ttl_s=ttl_s)
        self.snapshots[snapshot_id] = (header, bytes(data))
        return len(data)

    async def get_into(self, snapshot_id: str, out: memoryview, start_chunk: int = 0,
                       consume: bool = False,
                       timeout_s: float | None = None) -> cache_pb2.SnapshotHeader:
        await self._wait(timeout_s)
        if snapshot_id not in self.snapshots:
            raise errors.NotFound(f"snapshot {snapshot_id!r} not found")
        header, data = self.snapshots[snapshot_id]
        if len(data) != out.nbytes:
            raise errors.InvalidArgument(f"buffer has {out.nbytes} bytes, snapshot {len(data)}")
        out[:] = data
        if consume:
            del self.snapshots[snapshot_id]
        return header

    async def put_shared(self, *args: object, **kwargs: object) -> int | None:
        return None  # no arena: the worker streams through put

    async def get_shared(self, *args: object, **kwargs: object) -> None:
        return None

    async def close(self) -> None:
        self.closed = True


@dataclass(slots=True)
class WorkerProcess:
    process: asyncio.subprocess.Process
    address: str  # announced on its ready line


@contextlib.asynccontextmanager
async def worker_process(*flags: str) -> AsyncIterator[WorkerProcess]:
    """`python -m gpu_worker --listen 127.0.0.1:0 FLAGS`, once it announced
    itself ready; killed on the way out unless it already exited."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpu_worker", "--listen", "127.0.0.1:0", "--log-level", "warning",
        *flags, cwd=REPO, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode().split()
        assert line[:2] == ["KVSTASH_READY", "worker"], line
        yield WorkerProcess(process, line[2])
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
