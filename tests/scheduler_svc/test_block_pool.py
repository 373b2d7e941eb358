from __future__ import annotations

import pytest

from kvstash.errors import IntegrityError, InvalidArgument
from scheduler_svc.core.block_pool import BlockPool


def test_allocate_and_free_keep_the_invariant() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    assert pool.num_free_blocks == 1
    pool.check_integrity([a])
    pool.free(a)
    assert pool.num_free_blocks == 4
    pool.check_integrity([])


def test_misuse_raises() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(InvalidArgument, match="double free of block 0"):
        pool.free(blocks)
    with pytest.raises(InvalidArgument, match="need 3 blocks, 2 free and 0 evictable"):
        pool.allocate(3)
    with pytest.raises(InvalidArgument, match="not in use"):
        pool.cache_block(0, 123)
    with pytest.raises(InvalidArgument, match="free and holds no cached prefix"):
        pool.touch([1])


def test_cached_blocks_become_evictable_and_can_be_hit_again() -> None:
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    assert pool.cache_block(block, 42)
    pool.free([block])
    assert (pool.num_free_blocks, pool.num_evictable_blocks) == (2, 1)
    assert pool.cached_run([42]) == [block]
    pool.touch([block])
    assert pool.ref_cnt(block) == 1 and pool.num_evictable_blocks == 0
    pool.check_integrity([[block]])


def test_duplicate_prefix_stays_uncached() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 7)
    assert not pool.cache_block(b, 7)
    pool.free([a, b])
    assert (pool.num_free_blocks, pool.num_evictable_blocks) == (1, 1)


def test_eviction_is_lru_and_forgets_the_hash() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.cache_block(block, 100 + i)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    # Released order 1, 0, 2: block 1 is the least recently used.
    assert pool.allocate(1) == [blocks[1]]
    assert pool.cached_run([101]) == []
    assert pool.allocate(1) == [blocks[0]]
    assert pool.cached_run([102]) == [blocks[2]]
    pool.check_integrity([[blocks[1]], [blocks[0]]])


def test_free_releases_the_tail_first() -> None:
    pool = BlockPool(2)
    head, tail = pool.allocate(2)
    pool.cache_block(head, 1)
    pool.cache_block(tail, 2)
    pool.free([head, tail])
    assert pool.allocate(1) == [tail]  # the head is likelier to be shared again


def test_shared_blocks_count_every_holder() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache_block(block, 5)
    pool.touch([block])
    pool.check_integrity([[block], [block]])
    with pytest.raises(IntegrityError, match="ref_cnt 2 but 1 block tables hold it"):
        pool.check_integrity([[block]])


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool._free_ids.append(blocks[0])  # corrupt: in use and free at once
    with pytest.raises(IntegrityError, match="free 3 \\+ evictable 0 \\+ in use 2 = 5, pool has 4"):
        pool.check_integrity([blocks])
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool._ref_cnts[blocks[1]] = 3  # corrupt refcount
    with pytest.raises(IntegrityError, match="block 1 has ref_cnt 3 but 1 block tables hold it"):
        pool.check_integrity([blocks])


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(4)
    held, released = pool.allocate(1), pool.allocate(1)
    assert pool.cache_block(held[0], 1) and pool.cache_block(released[0], 2)
    pool.free(released)
    assert pool.reset_prefix_cache() == 1
    assert (pool.num_free_blocks, pool.num_evictable_blocks) == (3, 0)
    assert pool.cached_run([1]) == [] and pool.cached_run([2]) == []
    pool.check_integrity([held])
    pool.free(held)  # a held block comes back free, not evictable
    assert (pool.num_free_blocks, pool.num_evictable_blocks) == (4, 0)
    pool.check_integrity([])


def test_a_cached_run_stops_at_the_first_hash_not_cached() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)  # block 0 among them: a hit, not a stop
    assert 0 in blocks
    for block, block_hash in zip(blocks, (11, 12, 13, 14), strict=True):
        pool.cache_block(block, block_hash)
    assert pool.cached_run([11, 12, 13, 14]) == blocks
    assert pool.cached_run([11, 99, 13]) == blocks[:1]  # 13 is cached, but after a miss
    assert pool.cached_run([99, 11]) == [] and pool.cached_run([]) == []


def test_unreferenced_blocks_are_counted() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[0], 7)
    pool.free(blocks[:1])  # cached, held by no one: evictable
    assert pool.num_unreferenced(blocks) == 1 and pool.num_unreferenced([]) == 0
    pool.touch(blocks[:1])
    assert pool.num_unreferenced(blocks) == 0
