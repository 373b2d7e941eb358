"""The Worker gRPC service over a real socket (port 0), with an in-memory
stand-in for the cache service."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import pytest
import torch
from tokenizers import Tokenizer, models

from gpu_worker.config import WorkerConfig
from gpu_worker.host_buffers import HostBlocks
from gpu_worker.runner import ModelRunner, SeqWork
from gpu_worker.server import WorkerServer, create_worker_server
from kvstash import errors
from kvstash.common import rpc_connections
from kvstash.common.rpc_connections import MAX_MESSAGE_BYTES, insecure_channel
from kvstash.common.sampling import SamplingParams
from kvstash.common.wire import sampling_to_proto
from kvstash.v1 import cache_pb2, common_pb2, worker_pb2, worker_pb2_grpc
from scheduler_svc.worker_link import WORKER_CHANNEL_OPTIONS
from tests.gpu_worker.worker_factories import (
    MemoryCache,
    blocks_for,
    greedy_generate,
    make_runner,
    prompt,
)


@dataclass
class Harness:
    worker: WorkerServer
    stub: worker_pb2_grpc.WorkerStub
    cache: MemoryCache | None


async def _start(cache: MemoryCache | None, runner: ModelRunner | None = None,
                 timeout_s: float = 5.0) -> tuple[Harness, grpc.aio.Channel]:
    config = WorkerConfig(block_size=4, num_blocks=64, cache_timeout_s=timeout_s)
    worker = await create_worker_server(config, "127.0.0.1:0", runner or make_runner(), cache)
    channel = insecure_channel(f"127.0.0.1:{worker.port}")
    return Harness(worker, worker_pb2_grpc.WorkerStub(channel), cache), channel


async def _stop(h: Harness, channel: grpc.aio.Channel) -> None:
    await channel.close()
    await h.worker.server.stop(None)
    await h.worker.servicer.close()


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h, channel = await _start(MemoryCache())
    yield h
    await _stop(h, channel)
    assert h.cache is not None and h.cache.closed


def seq_proto(seq: SeqWork) -> worker_pb2.SeqWork:
    proto = worker_pb2.SeqWork(
        request_id=seq.request_id, token_ids=list(seq.token_ids), start_pos=seq.start_pos,
        block_ids=list(seq.block_ids), sample=seq.sample,
    )
    if seq.sample:  # as the scheduler sends it; a chunk that samples nothing has none
        proto.sampling.CopyFrom(sampling_to_proto(seq.sampling))
    return proto


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
    # What gateways are told the model is: the tiny one is Llama-shaped.
    assert (info.model_type, list(info.architectures)) == ("llama", ["LlamaForCausalLM"])
    assert info.kv_layout == common_pb2.KvLayout(num_layers=4, block_size=4, num_kv_heads=2,
                                                 head_dim=32, dtype="float32")
    # What else decides its KV's bits: this CPU, this torch, batch-invariant whole steps.
    hardware, version, steps, attention = info.numerics.split("|")
    assert hardware == f"cpu {torch.backends.cpu.get_cpu_capability()}"
    assert (version, steps, attention) == (f"torch {torch.__version__}", "whole steps",
                                           "torch attention")


async def test_a_tokenizer_larger_than_a_message_reaches_the_scheduler() -> None:
    """Llama 3's tokenizer.json is ~9 MB, past the 8 MiB message limit: the
    worker may send, and the scheduler's channel take, a GetInfo that big."""
    words = {f"w{i:07d}": i for i in range(500_000)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0000000")).to_str()
    assert len(tokenizer) > MAX_MESSAGE_BYTES
    runner = make_runner()
    runner.tokenizer_json = tokenizer
    worker = await create_worker_server(WorkerConfig(), "127.0.0.1:0", runner, MemoryCache())
    address = f"127.0.0.1:{worker.port}"
    try:
        async with rpc_connections.channel(address, options=WORKER_CHANNEL_OPTIONS) as channel:
            info = await worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        assert info.tokenizer_json == tokenizer.encode()
        async with insecure_channel(address) as other:  # any other client keeps the limit
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await worker_pb2_grpc.WorkerStub(other).GetInfo(worker_pb2.GetInfoRequest())
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await worker.server.stop(None)


async def test_a_step_plan_larger_than_a_message_reaches_the_worker() -> None:
    """A plan carries every sequence's whole block table: 512 sequences of
    128k-token contexts in blocks of 16 are ~13 MiB, past the 8 MiB limit
    both ends kept (every step failed, as a lost worker). Here one table
    that long, of which the step's one position uses its first block."""
    runner = make_runner(num_blocks=256)
    worker = await create_worker_server(WorkerConfig(), "127.0.0.1:0", runner, MemoryCache())
    try:
        async with rpc_connections.channel(f"127.0.0.1:{worker.port}",
                                           options=WORKER_CHANNEL_OPTIONS) as channel:
            table = [0] + [255] * (MAX_MESSAGE_BYTES // 2)  # 2 bytes each on the wire
            seq = SeqWork("long", [5], 0, table, True)
            assert seq_proto(seq).ByteSize() > MAX_MESSAGE_BYTES
            [[(request_id, token)]] = await run_steps(worker_pb2_grpc.WorkerStub(channel), [[seq]])
        assert request_id == "long" and token == make_runner().execute([
            SeqWork("long", [5], 0, [0], True)])[0]
    finally:
        await worker.server.stop(None)


async def test_execute_matches_runner_and_streams_in_order(harness: Harness) -> None:
    a, b = prompt("Hello there"), prompt("General Kenobi!")
    ta, tb = blocks_for(32, 0), blocks_for(32, 10)
    seeded = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=11)
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


async def test_a_step_overwriting_another_requests_kv_is_refused(harness: Harness) -> None:
    """A block a buggy scheduler gave to two requests: the step that would have
    one write its KV over the other's is refused, and the other continues as if
    it never came."""
    ids = prompt("Keep my KV")  # 10 tokens: blocks 0..2 of 4
    table = blocks_for(len(ids) + 1, 0)
    want = greedy_generate(make_runner(), ids, 2, table)
    assert await run_steps(harness.stub, [[SeqWork("b", ids, 0, table, True)]]) == [
        [("b", want[0])]]
    clash = [SeqWork("a", [7, 8, 9, 10], 0, [1]), SeqWork("b", [want[0]], len(ids), table, True)]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_steps(harness.stub, [clash])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 'a' writes block 1, which request 'b' also holds" in (
        info.value.details() or "")
    assert await run_steps(harness.stub, [[clash[1]]]) == [[("b", want[1])]]


async def test_bad_sampling_is_invalid_argument_naming_the_value(harness: Harness) -> None:
    bad = {"top_p": common_pb2.SamplingParams(max_tokens=1, top_p=1.5),
           "temperature": common_pb2.SamplingParams(max_tokens=1, temperature=-1.0),
           "max_tokens": common_pb2.SamplingParams(top_k=3)}
    for name, sampling in bad.items():
        call = harness.stub.Execute()
        await call.write(worker_pb2.StepPlan(step_id=0, seqs=[worker_pb2.SeqWork(
            request_id="x", token_ids=[1, 2], block_ids=[0], sample=True, sampling=sampling)]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{name} must be" in (info.value.details() or "")
    # A chunk that samples nothing carries no sampling to check.
    unsampled = worker_pb2.SeqWork(request_id="x", token_ids=[1, 2], block_ids=[0],
                                   sampling=bad["top_p"])
    call = harness.stub.Execute()
    await call.write(worker_pb2.StepPlan(step_id=0, seqs=[unsampled]))
    assert (await call.read()).sampled == []
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_bad_ids_and_undecodable_bytes_are_short_invalid_arguments(
        harness: Harness) -> None:
    long_id = "s" * 10_000
    cases = [
        (worker_pb2.OffloadRequest(request_id="a", snapshot_id=long_id, block_ids=[0],
                                   num_tokens=1), "snapshot id has 10000 chars"),
        (worker_pb2.OffloadRequest(request_id="a", snapshot_id="../etc", block_ids=[0],
                                   num_tokens=1), "has characters outside [A-Za-z0-9._-]"),
        (worker_pb2.OffloadRequest(request_id="", snapshot_id="s", block_ids=[0],
                                   num_tokens=1), "request_id must be 1-256 visible ASCII"),
        (worker_pb2.RestoreRequest(request_id=long_id, snapshot_id="snap", block_ids=[0]),
         "request_id must be 1-256 visible ASCII"),
        (worker_pb2.RestoreRequest(request_id="a", snapshot_id=".hidden", block_ids=[0]),
         "must not start with '.'"),
    ]
    for request, text in cases:
        call = (harness.stub.Offload(request) if isinstance(request, worker_pb2.OffloadRequest)
                else harness.stub.Restore(request))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert text in (info.value.details() or "")
        assert len(info.value.details() or "") < 200
    assert harness.cache is not None and harness.cache.timeouts == []  # refused before the cache
    async with insecure_channel(f"127.0.0.1:{harness.worker.port}") as channel:
        raw = channel.unary_unary("/kvstash.v1.Worker/Offload")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"\x0a\x02\xff\xfe")  # request_id with invalid UTF-8
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "<class" not in (info.value.details() or "")


async def test_step_request_ids_follow_the_request_id_rule(harness: Harness) -> None:
    """As in Offload and Restore: an id that is empty, too long or not visible
    ASCII is refused, in a short error (a step error names its request)."""
    for request_id in ["", "s" * 100_000, "two\nlines"]:
        call = harness.stub.Execute()
        await call.write(worker_pb2.StepPlan(step_id=0, seqs=[worker_pb2.SeqWork(
            request_id=request_id, token_ids=[1, 2], block_ids=[0])]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id must be 1-256 visible ASCII" in (info.value.details() or "")
        assert len(info.value.details() or "") < 200


async def test_offload_then_restore_into_other_blocks_continues_identically(
        harness: Harness) -> None:
    ids = prompt("Stash me, then bring me back.")
    old, new = blocks_for(len(ids) + 8, 0), blocks_for(len(ids) + 8, 30)
    [[(_, first)]] = await run_steps(harness.stub, [[SeqWork("a", ids, 0, old, True)]])
    used = old[: -(-len(ids) // 4)]
    off = await harness.stub.Offload(worker_pb2.OffloadRequest(
        request_id="a", snapshot_id="snap-a", block_ids=used, num_tokens=len(ids)))
    assert off.num_bytes == len(used) * 2 * 4 * 4 * 2 * 32 * 4
    assert harness.cache is not None
    header = harness.cache.snapshots["snap-a"][0]
    assert header.num_blocks == len(used) and header.num_tokens == len(ids) and header.pinned
    restored = await harness.stub.Restore(worker_pb2.RestoreRequest(
        request_id="a", snapshot_id="snap-a", block_ids=new[: len(used)]))
    assert restored.num_bytes == off.num_bytes
    assert "snap-a" not in harness.cache.snapshots  # the restore consumed it
    steps_new = [[SeqWork("a", [first], len(ids), new, True)]]
    steps_old = [[SeqWork("b", [first], len(ids), old, True)]]
    assert (await run_steps(harness.stub, steps_new))[0][0][1] == (
        await run_steps(harness.stub, steps_old))[0][0][1]


async def test_restore_checks_the_snapshot(harness: Harness) -> None:
    assert harness.cache is not None
    await harness.stub.Offload(worker_pb2.OffloadRequest(
        request_id="r", snapshot_id="two", block_ids=[0, 1], num_tokens=5))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.stub.Restore(worker_pb2.RestoreRequest(request_id="r", snapshot_id="two",
                                                             block_ids=[5, 6, 7]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'two' into 3 blocks: buffer has 24576 bytes, snapshot 16384" in (
        info.value.details() or "")
    header, _ = harness.cache.snapshots["two"]
    header.layout.dtype = "float16"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.stub.Restore(worker_pb2.RestoreRequest(request_id="r", snapshot_id="two",
                                                             block_ids=[5, 6]))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "float16" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.stub.Restore(worker_pb2.RestoreRequest(request_id="r", snapshot_id="nope",
                                                             block_ids=[5]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.stub.Offload(worker_pb2.OffloadRequest(
            request_id="r", snapshot_id="big", block_ids=[0, 1], num_tokens=9))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_tokens 9 must be in 1..8" in (info.value.details() or "")


async def test_offload_without_cache_or_deadline_uses_cache_timeout() -> None:
    for cache, code, text in [(None, grpc.StatusCode.FAILED_PRECONDITION, "no cache service"),
                              (MemoryCache(delay_s=None), grpc.StatusCode.UNAVAILABLE,
                               # the time left, a little under 0.2 s on a loaded machine
                               "cache service did not finish within 0.")]:
        h, channel = await _start(cache, timeout_s=0.2)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.stub.Offload(worker_pb2.OffloadRequest(
                    request_id="r", snapshot_id="s", block_ids=[0], num_tokens=1))
            assert info.value.code() == code and text in (info.value.details() or "")
            if cache is not None:
                [timeout_s] = cache.timeouts
                assert timeout_s is not None and 0 < timeout_s <= 0.2
        finally:
            await _stop(h, channel)


async def test_callers_deadline_bounds_the_cache_calls() -> None:
    # The caller's deadline governs, shorter or longer than cache_timeout_s.
    stalled = MemoryCache(delay_s=None)
    h, channel = await _start(stalled, timeout_s=30.0)
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.Offload(worker_pb2.OffloadRequest(
                request_id="r", snapshot_id="s", block_ids=[0], num_tokens=1), timeout=0.5)
        assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                     grpc.StatusCode.UNAVAILABLE)
        assert loop.time() - started < 5.0
        [timeout_s] = stalled.timeouts  # about 0.5 s (grpc's clocks may add a few ms)
        assert timeout_s is not None and 0 < timeout_s < 0.6
    finally:
        await _stop(h, channel)
    slow = MemoryCache(delay_s=0.5)
    h, channel = await _start(slow, timeout_s=0.2)
    try:
        request = worker_pb2.OffloadRequest(request_id="r", snapshot_id="s", block_ids=[0],
                                            num_tokens=1)
        assert (await h.stub.Offload(request, timeout=20)).num_bytes > 0
        restore = worker_pb2.RestoreRequest(request_id="r", snapshot_id="s", block_ids=[1])
        assert (await h.stub.Restore(restore, timeout=20)).num_bytes > 0
        assert all(t is not None and 0.2 < t < 21 for t in slow.timeouts)
    finally:
        await _stop(h, channel)


class CorruptCache(MemoryCache):
    """Every read fails its checksum, as CacheClient reports it."""

    async def get_into(self, snapshot_id: str, out: memoryview, start_chunk: int = 0,
                       consume: bool = False,
                       timeout_s: float | None = None) -> cache_pb2.SnapshotHeader:
        raise errors.DataLoss(f"snapshot {snapshot_id}: chunk 0 checksum 0x1, server sent 0x2")


async def test_corrupt_snapshot_is_data_loss() -> None:
    h, channel = await _start(CorruptCache())
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.Restore(worker_pb2.RestoreRequest(request_id="r", snapshot_id="s",
                                                           block_ids=[0]))
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        assert "chunk 0 checksum 0x1" in (info.value.details() or "")
    finally:
        await _stop(h, channel)


async def test_copies_borrow_pooled_host_buffers_and_give_them_back() -> None:
    """No host allocation per copy: buffers come from the runner's pool (pinned on
    CUDA, where a new one costs ~0.5 s per GiB) and return to it, even on failure."""
    runner = make_runner()
    h, channel = await _start(MemoryCache(), runner)
    try:
        pool = runner.host_pool
        for i in range(4):
            await h.stub.Offload(worker_pb2.OffloadRequest(
                request_id="r", snapshot_id=f"s{i}", block_ids=[0, 1, 2], num_tokens=9))
            await h.stub.Restore(worker_pb2.RestoreRequest(
                request_id="r", snapshot_id=f"s{i}", block_ids=[8, 9, 10]))
        with pytest.raises(grpc.aio.AioRpcError):  # a failed copy returns its loan too
            await h.stub.Restore(worker_pb2.RestoreRequest(
                request_id="r", snapshot_id="gone", block_ids=[8, 9, 10]))
        assert pool.num_allocations == 1 and pool.num_lent == 0
    finally:
        await _stop(h, channel)


async def test_block_ids_are_checked_before_a_buffer_is_sized_or_a_snapshot_read() -> None:
    """100k block ids must not size a host buffer (or reach UNKNOWN), and a
    restore into repeated blocks must not consume the snapshot it would read."""
    runner = make_runner()
    h, channel = await _start(MemoryCache(), runner)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.Offload(worker_pb2.OffloadRequest(
                request_id="r", snapshot_id="huge", block_ids=list(range(100_000)),
                num_tokens=4))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(info.value.details() or "") < 300
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.Offload(worker_pb2.OffloadRequest(
                request_id="r", snapshot_id="twice", block_ids=[3, 3], num_tokens=4))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block ids [3] repeat" in (info.value.details() or "")
        await h.stub.Offload(worker_pb2.OffloadRequest(
            request_id="r", snapshot_id="kept", block_ids=[0, 1], num_tokens=5))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.Restore(worker_pb2.RestoreRequest(
                request_id="r", snapshot_id="kept", block_ids=[9, 9]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert h.cache is not None and "kept" in h.cache.snapshots  # not consumed
        assert runner.host_pool.num_allocations == 1 and runner.host_pool.num_lent == 0
    finally:
        await _stop(h, channel)


async def test_more_block_ids_than_the_pool_are_refused_by_their_count(
        harness: Harness) -> None:
    """An Offload or Restore naming millions of block ids (one block over and
    over) was walked id by id on the event loop before its repeats were
    found: 30M ids held health checks and every transfer for ~2 s. More ids
    than the pool's 64 blocks are refused by their count."""
    many = [5] * 2_000_000
    calls = [harness.stub.Offload(worker_pb2.OffloadRequest(
                 request_id="r", snapshot_id="many", block_ids=many, num_tokens=4)),
             harness.stub.Restore(worker_pb2.RestoreRequest(
                 request_id="r", snapshot_id="many", block_ids=many))]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2000000 block ids, more than the 64 blocks of this worker" in (
            info.value.details() or "")
    assert harness.cache is not None and harness.cache.timeouts == []  # refused before it
    assert await run_steps(harness.stub, [[SeqWork("z", [1, 2], 0, [0], True)]])


@pytest.mark.parametrize("copy", ["offload", "restore"])
async def test_a_copy_cancelled_while_its_buffer_is_taken_gives_it_back(copy: str) -> None:
    """The caller's deadline passes while the compute thread takes the copy's
    host buffer (a first pinned allocation takes ~0.5 s per GiB on CUDA): once
    taken, the buffer goes back to the pool, not lent forever."""
    runner = make_runner()
    h, channel = await _start(MemoryCache(), runner)
    pool, allocating = runner.host_pool, threading.Event()
    acquire = pool.acquire

    def slow_acquire(num_blocks: int) -> HostBlocks:
        allocating.wait(10.0)
        return acquire(num_blocks)

    try:
        await h.stub.Offload(worker_pb2.OffloadRequest(
            request_id="r", snapshot_id="s", block_ids=[0, 1], num_tokens=8))
        pool.acquire = slow_acquire  # type: ignore[method-assign]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if copy == "offload":
                await h.stub.Offload(worker_pb2.OffloadRequest(
                    request_id="r", snapshot_id="t", block_ids=[2, 3], num_tokens=8),
                    timeout=0.3)
            else:
                await h.stub.Restore(worker_pb2.RestoreRequest(
                    request_id="r", snapshot_id="s", block_ids=[4, 5]), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.sleep(0.1)  # the server cancels the handler
        allocating.set()
        await asyncio.wrap_future(h.worker.servicer._compute.submit(lambda: None))
        await asyncio.sleep(0.05)  # the taken loan's done-callback
        assert pool.num_lent == 0 and len(pool._idle) == 1
    finally:
        allocating.set()
        await _stop(h, channel)
