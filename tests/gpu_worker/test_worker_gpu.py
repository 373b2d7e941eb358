"""The batched step's guarantees on CUDA, in bf16: the same checks as the CPU
tests (rows alone vs batched, the preemption oracle, sampling), plus what only
a GPU can show (flash vs torch attention, one host sync per step, pinned
pooled buffers). `make test-gpu` runs these; without CUDA they are skipped."""

from __future__ import annotations

import asyncio
import random
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cache_svc.config import CacheConfig
from cache_svc.server import create_cache_server
from gpu_worker import fixed_gemm
from gpu_worker.attention import AttentionBackend
from gpu_worker.config import tiny_model_config
from gpu_worker.model import build_tiny_model
from gpu_worker.runner import ModelRunner, SeqWork
from gpu_worker.sampling import SamplingBatch, SamplingParams, sample_rows, to_device
from gpu_worker.transfer import KvTransfer
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common.units import MIB
from tests.gpu_worker.test_worker_batched import PROMPTS, Request, run, tables
from tests.gpu_worker.worker_factories import BLOCK_SIZE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch sees none); run with make test-gpu"),
]


def cuda_runner(attention: AttentionBackend | None = None, dtype: torch.dtype = torch.bfloat16,
                batch_invariant: bool = True,
                cuda_graph_rows: int | None = None) -> ModelRunner:
    model = build_tiny_model(tiny_model_config(), seed=0, dtype=dtype, device="cuda")
    return ModelRunner(model, block_size=BLOCK_SIZE, num_blocks=512, attention=attention,
                       batch_invariant=batch_invariant, cuda_graph_rows=cuda_graph_rows)


def assert_rows_equal_alone(alone: ModelRunner, batched: ModelRunner,
                            prompts: dict[str, list[int]], steps: int, share: float,
                            seed: int, table_blocks: int = 40) -> None:
    """Every prompt prefilled in one step, then `steps` decode steps of
    random subsets (each sequence in with probability `share`, in random
    order): every row's logits are its sequence's run alone, to the bit."""
    rng = random.Random(seed)
    table = tables(num_blocks=table_blocks)
    together = batched.logits([SeqWork(r, ids, 0, table[r]) for r, ids in prompts.items()])
    last = {}
    for row, (rid, ids) in zip(together, prompts.items(), strict=True):
        assert torch.equal(row, alone.logits([SeqWork(rid, ids, 0, table[rid])])[0]), rid
        last[rid] = (int(row.argmax()), len(ids))
    for _ in range(steps):
        rids = [r for r in prompts if rng.random() < share] or ["r0"]
        rng.shuffle(rids)
        seqs = [SeqWork(r, [last[r][0]], last[r][1], table[r]) for r in rids]
        for seq, row in zip(seqs, batched.logits(seqs), strict=True):
            assert torch.equal(row, alone.logits([seq])[0]), seq.request_id
            last[seq.request_id] = (int(row.argmax()), seq.start_pos + 1)


@pytest.mark.parametrize("attention", list(AttentionBackend))
def test_batched_rows_equal_each_sequence_alone(attention: AttentionBackend) -> None:
    assert_rows_equal_alone(cuda_runner(attention), cuda_runner(attention), PROMPTS, steps=24,
                            share=0.6, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_attention_rows_past_many_chunks_equal_each_sequence_alone(
        dtype: torch.dtype) -> None:
    """The torch path past 256 positions: each row reads three 128-key chunks
    and more, 18 pairs a decode step, where the order a tile's pairs are
    added in would show (the GPU's index_add_ has none: attention.py adds
    them one chunk at a time)."""
    prompts = {rid: (ids * 40)[:260 + 8 * i] for i, (rid, ids) in enumerate(PROMPTS.items())}
    assert_rows_equal_alone(cuda_runner(AttentionBackend.TORCH, dtype),
                            cuda_runner(AttentionBackend.TORCH, dtype), prompts, steps=12,
                            share=0.7, seed=2, table_blocks=80)  # 320 positions each


def test_greedy_outputs_survive_offload_and_recompute_in_bf16() -> None:
    alone = {rid: run(cuda_runner(), [Request(rid, ids, [])], 16, chunk=8)[rid]
             for rid, ids in PROMPTS.items()}
    preempt = {6: ("r1", "offload"), 8: ("r3", "recompute"), 11: ("r0", "recompute"),
               13: ("r5", "offload"), 15: ("r1", "recompute")}
    together = run(cuda_runner(), [Request(rid, ids, []) for rid, ids in PROMPTS.items()], 16,
                   chunk=5, preempt=preempt)
    for rid, (output, logits) in alone.items():
        assert together[rid][0] == output, rid
        assert torch.equal(together[rid][1], logits), rid


def test_invariant_steps_run_whole_on_the_gpu() -> None:
    """With Triton, fixed_gemm passes the start-up check: one launch per op
    per step, not one per 128-row tile (batched.py)."""
    runner = cuda_runner()
    assert runner.batched.whole and runner.batched.matmul is fixed_gemm.matmul


@pytest.mark.parametrize("attention", list(AttentionBackend))
def test_cuda_graph_steps_give_the_eager_steps_bits(attention: AttentionBackend) -> None:
    """A step replayed from CUDA graphs (step_graphs.py) gives every row the
    bits the same step gets op by op, with either attention between the
    graphs: prefills, decodes and both mixed, in steps of two row counts
    taking turns (their sets share one memory pool); a step longer than the
    graphs' rows runs op by op, alone and between graphed ones."""
    big = cuda_runner(attention, cuda_graph_rows=256), cuda_runner(attention, cuda_graph_rows=0)
    small = cuda_runner(attention, cuda_graph_rows=128), cuda_runner(attention, cuda_graph_rows=0)
    graphs, small_graphs = big[0].batched.graphs, small[0].batched.graphs
    assert graphs is not None and small_graphs is not None and big[1].batched.graphs is None
    table, rids = tables(num_blocks=80), list(PROMPTS)  # 320 positions each
    done: dict[str, int] = {}  # request -> tokens in the cache
    last: dict[str, int] = {}  # request -> its next input token

    def step(runners: tuple[ModelRunner, ModelRunner], seqs: list[SeqWork]) -> None:
        rows = runners[0].logits(seqs)
        assert torch.equal(rows, runners[1].logits(seqs)), [s.request_id for s in seqs]
        for seq, row in zip(seqs, rows, strict=True):
            done[seq.request_id] = seq.start_pos + len(seq.token_ids)
            last[seq.request_id] = int(row.argmax())

    def decodes(among: list[str]) -> list[SeqWork]:
        return [SeqWork(r, [last[r]], done[r], table[r]) for r in among]

    def chunks(among: list[str]) -> list[SeqWork]:
        return [SeqWork(r, [last[r]] * 40, done[r], table[r]) for r in among]

    step(big, [SeqWork(r, PROMPTS[r], 0, table[r]) for r in rids[:2]])  # 25 rows: 128
    step(big, decodes(rids[:2]) + [SeqWork(r, PROMPTS[r], 0, table[r]) for r in rids[2:]])
    for _ in range(3):  # the two row counts take turns
        step(big, decodes(rids))  # 128
        step(big, decodes(rids[:2]) + chunks(rids[2:]))  # 162 rows: 256
    layers = tiny_model_config().num_layers
    assert graphs.captured == [(128, layers), (256, layers)]
    step(small, [SeqWork(r, ids, 0, table[r]) for r, ids in PROMPTS.items()])  # 159: 256
    assert small_graphs.captured == []
    for _ in range(3):  # graphed and op by op in turns
        step(small, decodes(rids))  # 128: graphs
        step(small, chunks(rids[:4]))  # 160 rows: op by op
    assert small_graphs.captured == [(128, layers)] and small_graphs.failed == set()


def test_cuda_graphs_cut_a_decode_steps_launches() -> None:
    """One decode step launches under half the kernels and copies op by op."""
    from torch.profiler import ProfilerActivity, profile

    from bench.worker_bench import LAUNCH_CALLS

    def launches(runner: ModelRunner) -> int:
        table = tables()
        runner.execute([SeqWork(r, ids, 0, table[r]) for r, ids in PROMPTS.items()])
        decode = [SeqWork(r, [1], len(ids), table[r], True) for r, ids in PROMPTS.items()]
        runner.execute(decode)  # warm-up: captures the graphs
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.execute([SeqWork(s.request_id, [2], s.start_pos + 1, s.block_ids, True)
                            for s in decode])
        return sum(1 for e in prof.events() if e.name in LAUNCH_CALLS)

    graphed, eager = launches(cuda_runner()), launches(cuda_runner(cuda_graph_rows=0))
    assert graphed * 2 < eager, (graphed, eager)


@pytest.mark.parametrize(("k", "out", "in_out"), [(2048, 3072, True), (8192, 2048, True),
                                                   (2048, 32000, False)])
def test_fixed_gemm_rows_do_not_depend_on_the_row_count_in_bf16(k: int, out: int,
                                                                 in_out: bool) -> None:
    """At Llama-3.2-1B's shapes (q/k/v, down_proj, a tied output head laid
    out [vocab, hidden]): each row bit for bit the same among 1 to 4,096 rows."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(out, k, generator=gen, device="cuda").to(torch.bfloat16)
    if in_out:
        weight = weight.t().contiguous().t()
    x = torch.randn(4096, k, generator=gen, device="cuda").to(torch.bfloat16)
    product = fixed_gemm.matmul(x, weight)
    torch.testing.assert_close(product.float(), (x.float() @ weight.float().t()),
                               atol=0.5, rtol=0.02)
    for rows in (1, 7, 128, 300, 1024):
        assert torch.equal(fixed_gemm.matmul(x[:rows], weight), product[:rows]), rows


def test_flash_and_torch_attention_agree() -> None:
    flash, plain = cuda_runner(AttentionBackend.FLASH), cuda_runner(AttentionBackend.TORCH)
    table = tables()
    seqs = [SeqWork(r, ids, 0, table[r]) for r, ids in PROMPTS.items()]
    torch.testing.assert_close(flash.logits(seqs).float(), plain.logits(seqs).float(),
                               atol=0.05, rtol=0.05)


def test_sampling_on_the_device_draws_what_the_host_draws() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 5000, generator=gen).to(torch.bfloat16)
    settings = [SamplingParams(max_tokens=4, temperature=0.5 + i % 3, top_k=i % 5 * 7,
                               top_p=1.0 if i % 2 else 0.8, seed=i) for i in range(64)]
    batch = SamplingBatch.build(settings, list(range(64)), torch.Generator())
    on_cpu = sample_rows(logits, to_device(batch, torch.device("cpu")), 16).tolist()
    on_gpu = sample_rows(logits.cuda(), to_device(batch, torch.device("cuda")), 16).tolist()
    assert on_gpu == on_cpu


def test_a_step_syncs_with_the_host_once() -> None:
    runner = cuda_runner()
    table = tables()
    seqs = [SeqWork(r, ids, 0, table[r], True,
                    SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=1))
            for r, ids in PROMPTS.items()]
    runner.execute(seqs)  # warm-up: allocations and kernel loading
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.execute([SeqWork(s.request_id, [1], len(s.token_ids), s.block_ids, True,
                                    s.sampling) for s in seqs])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


def test_pooled_host_buffers_are_pinned_and_round_trip() -> None:
    runner = cuda_runner()
    runner.execute([SeqWork("r", PROMPTS["r2"], 0, [1, 2, 3, 4, 5, 6])])
    with runner.host_pool.lend(6) as host:
        assert host.is_pinned()
        runner.gather_blocks_into([1, 2, 3, 4, 5, 6], host)
        runner.scatter_blocks([11, 12, 13, 14, 15, 16], host)
    assert torch.equal(runner.kv_cache[:, :, 11:17], runner.kv_cache[:, :, 1:7])


async def test_offload_and_restore_through_the_arena_are_pinned_dma() -> None:
    runner = cuda_runner()
    runner.execute([SeqWork("r", PROMPTS["r2"], 0, [1, 2, 3, 4, 5, 6])])
    # A tmpfs, as `kvstash up` gives the cache: CUDA refuses to pin a mapping
    # of a file on disk (cudaErrorInvalidValue on an H200 VM's /tmp).
    arena_dir = tempfile.TemporaryDirectory(dir="/dev/shm")
    _, port, cache = await create_cache_server(
        CacheConfig(memory_budget_bytes=64 * MIB, arena_dir=Path(arena_dir.name)),
        "127.0.0.1:0")
    client = CacheClient(f"127.0.0.1:{port}")
    try:
        with ThreadPoolExecutor(1) as compute:
            transfer = KvTransfer(runner, compute, client)
            deadline = asyncio.get_running_loop().time() + 60
            stored = await transfer.offload("s", [1, 2, 3, 4, 5, 6], 6 * BLOCK_SIZE, deadline)
            assert await transfer.restore("s", [11, 12, 13, 14, 15, 16], deadline) == stored
        region = runner._pinned_region
        assert region is not None  # the arena, registered with CUDA
        assert torch.frombuffer(region, dtype=torch.uint8).is_pinned()
        assert torch.equal(runner.kv_cache[:, :, 11:17], runner.kv_cache[:, :, 1:7])
        stats = await client.stats()
        assert (stats.num_shared_puts, stats.num_shared_gets) == (1, 1)
    finally:
        await client.close()
        await cache.stop(None)
        arena_dir.cleanup()


def test_a_cuda_index_becomes_the_current_device_and_is_checked() -> None:
    """`cuda:N` is made the current device (Triton kernels and graph capture
    follow it); an index past the devices torch sees is refused by name."""
    from gpu_worker.checkpoint import resolve_device

    last = torch.cuda.device_count() - 1
    assert resolve_device(f"cuda:{last}") == torch.device("cuda", last)
    assert torch.cuda.current_device() == last
    with pytest.raises(ValueError, match=f"cuda:{last + 1}"):
        resolve_device(f"cuda:{last + 1}")
    torch.cuda.set_device(0)
