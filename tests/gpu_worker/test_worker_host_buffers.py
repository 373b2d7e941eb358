"""The pooled host buffers offload and restore borrow (host_buffers)."""

from __future__ import annotations

import threading

import pytest
import torch

from gpu_worker.host_buffers import HostBlockPool
from gpu_worker.runner import SeqWork
from tests.gpu_worker.worker_factories import make_runner, prompt

SHAPE = (2, 2, 4, 2, 8)  # layers, k/v, block_size, kv_heads, head_dim
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4


def make_pool(max_idle_blocks: int = 64) -> HostBlockPool:
    return HostBlockPool(SHAPE, torch.float32, pinned=False,
                         max_idle_bytes=max_idle_blocks * BLOCK_BYTES)


def test_loans_are_contiguous_block_views_and_buffers_are_reused() -> None:
    pool = make_pool()
    with pool.lend(5) as blocks:
        assert blocks.shape == (2, 2, 5, 4, 2, 8) and blocks.is_contiguous()
        first = blocks.data_ptr()
    for n in (5, 8, 6, 1):  # 8 blocks is the buffer's capacity: all fit in it
        with pool.lend(n) as blocks:
            assert blocks.data_ptr() == first
    assert pool.num_allocations == 1 and pool.num_lent == 0
    assert pool.idle_bytes == 8 * BLOCK_BYTES


def test_idle_memory_stays_under_the_bound() -> None:
    pool = make_pool(max_idle_blocks=20)
    loans = [pool.acquire(n) for n in (16, 16, 4, 2)]
    for loan in loans:
        pool.release(loan)
    assert pool.idle_bytes <= 20 * BLOCK_BYTES
    assert pool.idle_bytes == (4 + 2) * BLOCK_BYTES  # over the bound, the largest went first
    for _ in range(50):
        with pool.lend(3), pool.lend(16):
            pass
    assert pool.idle_bytes <= 20 * BLOCK_BYTES


def test_concurrent_borrowers_never_share_a_buffer() -> None:
    pool = make_pool()
    errors: list[str] = []
    barrier = threading.Barrier(8)

    def borrow(worker: int) -> None:
        for round_ in range(30):
            with pool.lend(1 + (worker + round_) % 6) as blocks:
                blocks.fill_(worker)
                if round_ == 0:
                    barrier.wait()  # all eight hold a loan at once
                if not bool((blocks == worker).all()):
                    errors.append(f"worker {worker} saw another's writes")

    threads = [threading.Thread(target=borrow, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and pool.num_lent == 0
    assert pool.num_allocations < 8 * 30 // 4  # mostly reused
    assert pool.idle_bytes <= pool.max_idle_bytes


def test_bad_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 block, got 0"):
        make_pool().acquire(0)
    with pytest.raises(ValueError, match="max_idle_bytes must be >= 0"):
        HostBlockPool(SHAPE, torch.float32, pinned=False, max_idle_bytes=-1)


def test_runner_gathers_into_and_scatters_from_a_lent_buffer() -> None:
    runner = make_runner(num_blocks=16)
    runner.execute([SeqWork("r", prompt("pooled buffers!!"), 0, [3, 7, 1, 2])])
    with runner.host_pool.lend(4) as host:
        runner.gather_blocks_into([3, 7, 1, 2], host)
        runner.scatter_blocks([8, 9, 10, 11], host)
    assert torch.equal(runner.kv_cache[:, :, [8, 9, 10, 11]], runner.kv_cache[:, :, [3, 7, 1, 2]])
    with runner.host_pool.lend(3) as host, pytest.raises(ValueError, match="gather: got"):
        runner.gather_blocks_into([3, 7], host)
    assert runner.host_pool.num_allocations == 1
