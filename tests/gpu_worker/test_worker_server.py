"""The Worker gRPC service over a real socket (port 0), with an in-memory
stand-in for the cache service."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import pytest

from gpu_worker.config import WorkerConfig
from gpu_worker.runner import ModelRunner, SeqWork
from gpu_worker.sampling import SamplingParams
from gpu_worker.server import WorkerServer, create_worker_server
from kvstash import errors
from kvstash.rpc import insecure_channel
from kvstash.v1 import cache_pb2, common_pb2, worker_pb2, worker_pb2_grpc
from tests.gpu_worker.worker_factories import blocks_for, make_runner, prompt


class MemoryStore:
    """Keeps snapshots in a dict; mimics CacheClient's put/get_into contract."""

    def __init__(self, hang: bool = False) -> None:
        self.snapshots: dict[str, tuple[cache_pb2.SnapshotHeader, bytes]] = {}
        self.hang = hang
        self.closed = False

    async def put(self, snapshot_id: str, layout: common_pb2.KvLayout, num_blocks: int,
                  num_tokens: int, data: memoryview, pinned: bool = True, ttl_s: int = 0) -> int:
        if self.hang:
            await asyncio.sleep(3600)
        header = cache_pb2.SnapshotHeader(snapshot_id=snapshot_id, layout=layout,
                                          num_blocks=num_blocks, num_tokens=num_tokens,
                                          total_bytes=len(data), pinned=pinned, ttl_s=ttl_s)
        self.snapshots[snapshot_id] = (header, bytes(data))
        return len(data)

    async def get_into(self, snapshot_id: str, out: memoryview) -> cache_pb2.SnapshotHeader:
        if snapshot_id not in self.snapshots:
            raise errors.NotFound(f"snapshot {snapshot_id!r} not found")
        header, data = self.snapshots[snapshot_id]
        if len(data) != out.nbytes:
            raise errors.InvalidArgument(f"buffer has {out.nbytes} bytes, snapshot {len(data)}")
        out[:] = data
        return header

    async def close(self) -> None:
        self.closed = True


@dataclass
class Harness:
    worker: WorkerServer
    stub: worker_pb2_grpc.WorkerStub
    store: MemoryStore | None


async def _start(store: MemoryStore | None, runner: ModelRunner | None = None,
                 timeout_s: float = 5.0) -> tuple[Harness, grpc.aio.Channel]:
    config = WorkerConfig(block_size=4, num_blocks=64, cache_timeout_s=timeout_s)
    worker = await create_worker_server(config, "127.0.0.1:0", runner or make_runner(), store)
    channel = insecure_channel(f"127.0.0.1:{worker.port}")
    return Harness(worker, worker_pb2_grpc.WorkerStub(channel), store), channel


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h, channel = await _start(MemoryStore())
    yield h
    await channel.close()
    await h.worker.server.stop(None)
    await h.worker.servicer.close()
    assert h.store is not None and h.store.closed


def seq_proto(seq: SeqWork) -> worker_pb2.SeqWork:
    p = seq.sampling
    return worker_pb2.SeqWork(
        request_id=seq.request_id, token_ids=list(seq.token_ids), start_pos=seq.start_pos,
        block_ids=list(seq.block_ids), sample=seq.sample,
        sampling=common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k,
                                           top_p=p.top_p, seed=p.seed),
    )


async def run_steps(stub: worker_pb2_grpc.WorkerStub,
                    steps: Sequence[Sequence[SeqWork]]) -> list[list[tuple[str, int]]]:
    call = stub.Execute()
    out = []
    for step_id, seqs in enumerate(steps):
        await call.write(worker_pb2.StepPlan(step_id=step_id, seqs=[seq_proto(s) for s in seqs]))
        result = await call.read()
        assert result.step_id == step_id
        out.append([(s.request_id, s.token_id) for s in result.sampled])
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK  # the stream is over on both sides
    return out


async def test_get_info(harness: Harness) -> None:
    info = await harness.stub.GetInfo(worker_pb2.GetInfoRequest())
    assert info.model_name == "tiny" and info.vocab_size == 258 and info.max_model_len == 1024
    assert list(info.eos_token_ids) == [257] and info.num_blocks == 64
    assert info.device == "cpu" and info.tokenizer_json == b""
    assert info.kv_layout == common_pb2.KvLayout(num_layers=4, block_size=4, num_kv_heads=2,
                                                 head_dim=32, dtype="float32")


async def test_execute_matches_runner_and_streams_in_order(harness: Harness) -> None:
    a, b = prompt("Hello there"), prompt("General Kenobi!")
    ta, tb = blocks_for(32, 0), blocks_for(32, 10)
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=11)
    direct = make_runner()
    remote_steps: list[list[SeqWork]] = []
    last = {"a": 0, "b": 0}
    # Prefill a whole and b in two chunks (the first samples nothing), then decode.
    plans = [[SeqWork("a", a, 0, ta, True), SeqWork("b", b[:6], 0, tb)],
             [SeqWork("b", b[6:], 6, tb, True, seeded)]]
    for plan in plans:
        remote_steps.append(plan)
        for seq, token in zip(plan, direct.execute(plan), strict=True):
            if token is not None:
                last[seq.request_id] = token
    pos = {"a": len(a), "b": len(b)}
    expected = [[("a", last["a"])], [("b", last["b"])]]
    for _ in range(6):
        plan = [SeqWork("a", [last["a"]], pos["a"], ta, True),
                SeqWork("b", [last["b"]], pos["b"], tb, True, seeded)]
        remote_steps.append(plan)
        token_a, token_b = direct.execute(plan)
        assert token_a is not None and token_b is not None
        expected.append([("a", token_a), ("b", token_b)])
        last = {"a": token_a, "b": token_b}
        pos = {k: v + 1 for k, v in pos.items()}
    assert await run_steps(harness.stub, remote_steps) == expected


async def test_one_scheduler_at_a_time(harness: Harness) -> None:
    first = harness.stub.Execute()
    await first.write(worker_pb2.StepPlan(step_id=0))
    assert (await first.read()).step_id == 0
    second = harness.stub.Execute()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await second.read()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "another scheduler" in (info.value.details() or "")
    await first.done_writing()
    assert await first.code() == grpc.StatusCode.OK
    assert await run_steps(harness.stub, [[SeqWork("z", [1, 2], 0, [0], True)]])


async def test_bad_plan_is_invalid_argument_and_server_keeps_serving(harness: Harness) -> None:
    bad = [[SeqWork("x", [1, 999], 0, [0], True)]]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_steps(harness.stub, bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token ids [999] outside vocab of 258" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_steps(harness.stub, [[SeqWork("y", [1] * 9, 0, [0, 1], True)]])
    assert "9 positions need 3 blocks of 4, block table has 2" in (info.value.details() or "")
    ok = await run_steps(harness.stub, [[SeqWork("z", [1, 2], 0, [0], True)]])
    assert ok[0][0][0] == "z"


async def test_long_ids_and_undecodable_bytes_are_short_invalid_arguments(
        harness: Harness) -> None:
    long_id = "s" * 10_000
    for call in (harness.stub.Offload(worker_pb2.OffloadRequest(
                     request_id="a", snapshot_id=long_id, block_ids=[0], num_tokens=1)),
                 harness.stub.Restore(worker_pb2.RestoreRequest(
                     request_id=long_id, snapshot_id="snap", block_ids=[0]))):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "longer than 128 chars" in (info.value.details() or "")
        assert len(info.value.details() or "") < 200
    async with insecure_channel(f"127.0.0.1:{harness.worker.port}") as channel:
        raw = channel.unary_unary("/kvstash.v1.Worker/Offload")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"\x0a\x02\xff\xfe")  # request_id with invalid UTF-8
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "<class" not in (info.value.details() or "")


async def test_offload_then_restore_into_other_blocks_continues_identically(
        harness: Harness) -> None:
    ids = prompt("Stash me, then bring me back.")
    old, new = blocks_for(len(ids) + 8, 0), blocks_for(len(ids) + 8, 30)
    [[(_, first)]] = await run_steps(harness.stub, [[SeqWork("a", ids, 0, old, True)]])
    used = old[: -(-len(ids) // 4)]
    off = await harness.stub.Offload(worker_pb2.OffloadRequest(
        request_id="a", snapshot_id="snap-a", block_ids=used, num_tokens=len(ids), pinned=True))
    assert off.num_bytes == len(used) * 2 * 4 * 4 * 2 * 32 * 4
    assert harness.store is not None
    header = harness.store.snapshots["snap-a"][0]
    assert header.num_blocks == len(used) and header.num_tokens == len(ids) and header.pinned
    restored = await harness.stub.Restore(worker_pb2.RestoreRequest(
        request_id="a", snapshot_id="snap-a", block_ids=new[: len(used)]))
    assert restored.num_bytes == off.num_bytes
    steps_new = [[SeqWork("a", [first], len(ids), new, True)]]
    steps_old = [[SeqWork("b", [first], len(ids), old, True)]]
    assert (await run_steps(harness.stub, steps_new))[0][0][1] == (
        await run_steps(harness.stub, steps_old))[0][0][1]


async def test_restore_checks_the_snapshot(harness: Harness) -> None:
    assert harness.store is not None
    await harness.stub.Offload(worker_pb2.OffloadRequest(
        snapshot_id="two", block_ids=[0, 1], num_tokens=5))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.stub.Restore(worker_pb2.RestoreRequest(snapshot_id="two",
                                                             block_ids=[5, 6, 7]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'two' into 3 blocks: buffer has 24576 bytes, snapshot 16384" in (
        info.value.details() or "")
    header, _ = harness.store.snapshots["two"]
    header.layout.dtype = "float16"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.stub.Restore(worker_pb2.RestoreRequest(snapshot_id="two", block_ids=[5, 6]))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "float16" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.stub.Restore(worker_pb2.RestoreRequest(snapshot_id="nope", block_ids=[5]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.stub.Offload(worker_pb2.OffloadRequest(
            snapshot_id="big", block_ids=[0, 1], num_tokens=9))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_tokens 9 must be in 1..8" in (info.value.details() or "")


async def test_offload_without_cache_or_with_stuck_cache_fails_cleanly() -> None:
    for store, code, text in [(None, grpc.StatusCode.FAILED_PRECONDITION, "no cache service"),
                              (MemoryStore(hang=True), grpc.StatusCode.UNAVAILABLE,
                               "did not finish within 0.2 s")]:
        h, channel = await _start(store, timeout_s=0.2)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.stub.Offload(worker_pb2.OffloadRequest(
                    snapshot_id="s", block_ids=[0], num_tokens=1))
            assert info.value.code() == code and text in (info.value.details() or "")
        finally:
            await channel.close()
            await h.worker.server.stop(None)
            await h.worker.servicer.close()


class CorruptStore(MemoryStore):
    """Every read fails its checksum, as CacheClient reports it."""

    async def get_into(self, snapshot_id: str, out: memoryview) -> cache_pb2.SnapshotHeader:
        raise errors.DataLoss(f"snapshot {snapshot_id}: chunk 0 checksum 0x1, server sent 0x2")


async def test_corrupt_snapshot_is_data_loss() -> None:
    h, channel = await _start(CorruptStore())
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.Restore(worker_pb2.RestoreRequest(snapshot_id="s", block_ids=[0]))
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        assert "chunk 0 checksum 0x1" in (info.value.details() or "")
    finally:
        await channel.close()
        await h.worker.server.stop(None)
        await h.worker.servicer.close()
