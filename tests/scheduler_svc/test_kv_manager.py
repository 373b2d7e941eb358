from __future__ import annotations

import xxhash

from kvstash.common.sampling import SamplingParams
from scheduler_svc.core.kv_manager import KVCacheManager, chain_hashes
from scheduler_svc.core.request import Request


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request.create(
        request_id, prompt, SamplingParams(max_tokens=4), arrival_time=0.0, arrival_seq=0
    )


def test_identical_prefixes_share_computed_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.find_prefix(a) == []
    assert kv.allocate_slots(a, a.num_tokens) == [0, 1, 2]
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)  # [1,2] and [3,4] are full and computed; [5] is not
    b = make_request("b", [1, 2, 3, 4, 9, 9])
    prefix = kv.find_prefix(b)
    assert prefix == [0, 1]
    assert kv.allocate_slots(b, b.num_tokens - 4, prefix) == [3]
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 4
    assert kv.pool.ref_cnt(0) == 2
    kv.pool.check_integrity([a.block_ids, b.block_ids])


def test_prefix_hit_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    kv.cache_full_blocks(a)
    same = make_request("b", [1, 2, 3, 4])
    # Both blocks are cached, but the last token must be computed to sample.
    assert kv.find_prefix(same) == [0]


def test_freed_prefix_is_evictable_then_hit() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    kv.cache_full_blocks(a)
    kv.free(a)
    assert (kv.pool.num_free_blocks, kv.pool.num_evictable_blocks) == (3, 1)
    b = make_request("b", [1, 2, 7])
    prefix = kv.find_prefix(b)
    assert prefix == [0]
    # Taking an evictable hit uses up an allocatable block: with 3 reserved, no room.
    assert kv.allocate_slots(b, 1, prefix, num_reserved_blocks=3) is None
    assert kv.allocate_slots(b, 1, prefix, num_reserved_blocks=2) == [1]
    assert kv.pool.num_evictable_blocks == 0


def test_allocate_slots_grows_only_at_block_boundaries() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=2)
    a = make_request("a", [1])
    assert kv.allocate_slots(a, 1) == [0]
    a.num_computed_tokens = 1
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens = 2
    assert kv.allocate_slots(a, 1) == [1]
    a.num_computed_tokens = 4
    assert kv.allocate_slots(a, 1) is None  # pool exhausted; nothing changed
    assert a.block_ids == [0, 1]


def test_chained_block_hashes_are_per_block_xxh3_of_parent_and_tokens() -> None:
    """The format smg and the cache tier see: each whole block's 128-bit xxh3
    of its parent's 16 bytes and its uint32 tokens; a partial block has none."""
    tokens = [(i * 7919) % 50000 for i in range(4 * 5 + 3)]
    expected, parent = [], 0
    for b in range(5):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[4 * b:4 * b + 4])
        parent = xxhash.xxh3_128_intdigest(parent.to_bytes(16, "little") + block)
        expected.append(parent)
    assert chain_hashes(0, tokens, 4) == expected
    assert chain_hashes(expected[1], tokens[8:], 4) == expected[2:]
