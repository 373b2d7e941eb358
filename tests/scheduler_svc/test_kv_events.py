"""The prefix cache's events: what the core records, and how the hub numbers
and hands them out."""

from __future__ import annotations

import asyncio

from scheduler_svc.core.kv_events import BlockRemoved, BlockStored, CacheCleared
from scheduler_svc.kv_event_hub import KvEventHub
from tests.scheduler_svc.factories import add, make_scheduler, step


def test_nothing_is_recorded_unless_asked() -> None:
    core = make_scheduler()
    add(core, "a", prompt_len=9, max_tokens=2)
    step(core)
    assert core.take_kv_events() == []


def test_computed_full_blocks_are_stored_with_their_parent_and_tokens() -> None:
    core = make_scheduler()  # blocks of 4 tokens
    core.record_kv_events()
    add(core, "a", prompt_len=9, max_tokens=3)  # tokens 10..18
    step(core)  # prefill: blocks [10..13] and [14..17] are full
    first, second = core.take_kv_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert (first.token_ids, first.parent_hash) == ((10, 11, 12, 13), None)
    assert (second.token_ids, second.parent_hash) == ((14, 15, 16, 17), first.block_hash)
    step(core)  # the KV of position 9 (the first output token): block 3 not full yet
    assert core.take_kv_events() == []


def test_an_evicted_block_is_removed_and_a_reset_clears() -> None:
    core = make_scheduler(num_blocks=4)
    core.record_kv_events()
    add(core, "a", prompt_len=9, max_tokens=1)  # 3 blocks, 2 of them cached
    step(core)
    stored = [e for e in core.take_kv_events() if isinstance(e, BlockStored)]
    assert len(stored) == 2
    add(core, "b", prompt_len=12, max_tokens=1, first_token=50)  # needs 3 blocks: evicts
    step(core)
    events = core.take_kv_events()
    removed = [e.block_hash for e in events if isinstance(e, BlockRemoved)]
    assert removed and set(removed) <= {e.block_hash for e in stored}
    core.reset_prefix_cache()
    assert core.take_kv_events()[-1] == CacheCleared()


async def test_the_hub_numbers_batches_and_replays_what_a_subscriber_missed() -> None:
    hub = KvEventHub(block_size=4, keep=3)
    hub.publish([])  # nothing: no batch
    assert hub.sequence_number == 0
    for n in range(4):
        hub.publish([BlockStored(1000 + n, None, (n, n, n, n))])
    assert hub.sequence_number == 4
    stream = hub.subscribe(after=2)
    replayed = [await anext(stream), await anext(stream)]
    assert [b.sequence_number for b in replayed] == [3, 4]
    block = replayed[0].events[0].stored.blocks[0]
    assert (list(block.token_ids), block.block_size, block.block_hash) == ([2, 2, 2, 2], 4, 1002)
    hub.publish([BlockRemoved(2**127 + 5), CacheCleared()])
    live = await asyncio.wait_for(anext(stream), 1)
    assert live.sequence_number == 5
    removed, cleared = live.events
    assert list(removed.removed.block_hashes) == [5]  # 128-bit hashes fit int64 ids
    assert cleared.HasField("cleared") and removed.event_id + 1 == cleared.event_id
    await stream.aclose()


async def test_a_subscriber_that_falls_behind_is_dropped() -> None:
    hub = KvEventHub(block_size=4, keep=2)
    stream = hub.subscribe()
    hub.publish([CacheCleared()])  # primes the subscription
    assert (await anext(stream)).sequence_number == 1
    for _ in range(4):
        hub.publish([CacheCleared()])
    received = []
    async for batch in stream:
        received.append(batch.sequence_number)
    assert received == [2, 3]  # then its stream ended: it reconnects from 3


def test_prefix_hits_are_counted_in_tokens() -> None:
    core = make_scheduler()  # blocks of 4 tokens
    add(core, "a", prompt_len=9, max_tokens=1)
    [finished] = step(core)[1]
    assert core.stats().num_prefix_hit_tokens == 0
    assert finished.usage is not None and finished.usage.num_cached_tokens == 0
    add(core, "b", prompt_len=10, max_tokens=1)  # shares a's first 9 tokens: 2 full blocks
    [finished] = step(core)[1]
    assert core.stats().num_prefix_hit_tokens == 8
    assert core.stats().num_prefix_query_tokens == 9 + 10  # each prompt looked up
    assert finished.usage is not None and finished.usage.num_cached_tokens == 8  # its own
