"""BlockPool: the mechanism layer of KV block accounting (ids, refcounts, hashes).

Every block is in exactly one of three states:

    free       ref 0, no hash        kept in a stack; handed out first
    evictable  ref 0, hashed         still holds a valid cached prefix; kept in
                                     LRU order and reclaimed oldest-first when
                                     no free block is left
    in use     ref >= 1              held by that many block tables

A hash names the exact token prefix a FULL block ends (the block's tokens
chained with its parent's hash), so a later request with the same prefix can
take the block instead of computing it again. Every operation costs
O(blocks touched); only `check_integrity` walks the whole pool.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import takewhile
from typing import cast

from kvstash.errors import IntegrityError, InvalidArgument
from scheduler_svc.core.kv_events import BlockRemoved, CacheCleared, KvEventLog

_IS_BLOCK = functools.partial(operator.is_not, None)  # a lookup that found a block


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise InvalidArgument(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnts = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        # Popped from the end, so block 0 goes out first.
        self._free_ids = list(range(num_blocks - 1, -1, -1))
        # Oldest first: popitem(last=False) evicts the least recently freed.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        # Where evictions and resets are told (kv_events.py); None: nowhere.
        self.events: KvEventLog | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks `allocate` can hand out now: free plus evictable."""
        return len(self._free_ids) + len(self._evictable)

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnts[block_id]

    def num_unreferenced(self, block_ids: Iterable[int]) -> int:
        """How many of `block_ids` no request holds (cached ones: evictable)."""
        ref_cnts = self._ref_cnts
        return [ref_cnts[b] for b in block_ids].count(0)

    def block_hash(self, block_id: int) -> int | None:
        return self._hashes[block_id]

    def cached_run(self, block_hashes: Iterable[int]) -> list[int]:
        """The blocks cached under `block_hashes`, up to the first one that is
        not (lookups in C: a long prompt's prefix is thousands of blocks, and
        a waiting request's is looked up again every step)."""
        lookup: Callable[[int], int | None] = self._hash_to_block.get
        return cast(list[int], list(takewhile(_IS_BLOCK, map(lookup, block_hashes))))

    def evictable_in_order(self) -> Iterator[int]:
        """The evictable blocks, the next `allocate` evicts first (lazily: the
        pool must not change while it is walked)."""
        return iter(self._evictable)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free_ids) + len(self._evictable)

    def allocate(self, num_blocks: int) -> list[int]:
        """Hands out `num_blocks` blocks with ref 1, evicting LRU cached ones if needed."""
        if not self.can_allocate(num_blocks):
            raise InvalidArgument(
                f"need {num_blocks} blocks, {len(self._free_ids)} free and "
                f"{len(self._evictable)} evictable"
            )
        free_ids = self._free_ids
        num_free = min(num_blocks, len(free_ids))
        # Free blocks first, last freed first (in one slice), then the LRU cached.
        block_ids = free_ids[len(free_ids) - num_free:]
        del free_ids[len(free_ids) - num_free:]
        block_ids.reverse()
        for _ in range(num_blocks - num_free):
            block_id, _ = self._evictable.popitem(last=False)
            block_hash = self._hashes[block_id]
            assert block_hash is not None
            del self._hash_to_block[block_hash]
            self._hashes[block_id] = None
            if self.events is not None:
                self.events.append(BlockRemoved(block_hash))
            block_ids.append(block_id)
        ref_cnts = self._ref_cnts
        for block_id in block_ids:
            ref_cnts[block_id] = 1
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes one more reference on cached blocks (a prefix hit)."""
        ref_cnts = self._ref_cnts
        for block_id in block_ids:
            if ref_cnts[block_id] == 0:
                if block_id not in self._evictable:
                    raise InvalidArgument(f"block {block_id} is free and holds no cached prefix")
                del self._evictable[block_id]
            ref_cnts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drops one reference on each block; released blocks become free or evictable.

        Walks the table backwards so a request's tail blocks are evicted
        before its head, which other requests are likelier to share.
        """
        ref_cnts = self._ref_cnts
        for block_id in reversed(block_ids):
            ref_cnt = ref_cnts[block_id]
            if ref_cnt <= 0:
                raise InvalidArgument(f"double free of block {block_id}")
            ref_cnts[block_id] = ref_cnt - 1
            if ref_cnt == 1:
                if self._hashes[block_id] is None:
                    self._free_ids.append(block_id)
                else:
                    self._evictable[block_id] = None

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Registers a full, computed block under its prefix hash.

        Returns False (and leaves the block uncached) when another block
        already holds that prefix.
        """
        if self._ref_cnts[block_id] <= 0:
            raise InvalidArgument(f"block {block_id} is not in use, cannot cache it")
        if self._hashes[block_id] is not None:
            raise InvalidArgument(f"block {block_id} is already cached")
        if block_hash in self._hash_to_block:
            return False
        self._hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix, e.g. after the worker lost its KV tensor.

        Evictable blocks become free; blocks in use keep their holders but no
        hash, so they become free when released. Returns the blocks freed."""
        num_evictable = len(self._evictable)
        self._free_ids.extend(self._evictable)
        self._evictable.clear()
        self._hash_to_block.clear()
        self._hashes = [None] * self.num_blocks
        if self.events is not None:
            self.events.append(CacheCleared())
        return num_evictable

    def count_exclusive(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks would be released if one reference each were dropped."""
        ref_cnts = self._ref_cnts
        return sum(1 for block_id in block_ids if ref_cnts[block_id] == 1)

    def check_integrity(self, block_tables: Iterable[Sequence[int]]) -> None:
        """free + evictable + in use == total; refcounts == holders in `block_tables`.

        O(pool size): for tests and idle moments, never the hot path.
        """
        holders = [0] * self.num_blocks
        for table in block_tables:
            for block_id in table:
                if not 0 <= block_id < self.num_blocks:
                    raise IntegrityError(f"block table holds unknown block {block_id}")
                holders[block_id] += 1
        free = set(self._free_ids)
        if len(free) != len(self._free_ids):
            raise IntegrityError("a block is twice in the free list")
        num_in_use = sum(1 for ref_cnt in self._ref_cnts if ref_cnt > 0)
        total = len(free) + len(self._evictable) + num_in_use
        if total != self.num_blocks:
            raise IntegrityError(
                f"free {len(free)} + evictable {len(self._evictable)} + in use {num_in_use} "
                f"= {total}, pool has {self.num_blocks}"
            )
        for block_id in range(self.num_blocks):
            ref_cnt = self._ref_cnts[block_id]
            block_hash = self._hashes[block_id]
            if ref_cnt != holders[block_id]:
                raise IntegrityError(
                    f"block {block_id} has ref_cnt {ref_cnt} but {holders[block_id]} block "
                    "tables hold it"
                )
            if ref_cnt > 0 and (block_id in free or block_id in self._evictable):
                raise IntegrityError(f"block {block_id} is in use (ref {ref_cnt}) and free")
            if block_id in free and block_hash is not None:
                raise IntegrityError(f"free block {block_id} still has a hash")
            if block_id in self._evictable and block_hash is None:
                raise IntegrityError(f"evictable block {block_id} has no hash")
            if block_hash is not None and self._hash_to_block.get(block_hash) != block_id:
                raise IntegrityError(f"block {block_id}'s hash maps to another block")
        if len(self._hash_to_block) != sum(1 for h in self._hashes if h is not None):
            raise IntegrityError(
                f"{len(self._hash_to_block)} hashes registered, "
                f"{sum(1 for h in self._hashes if h is not None)} blocks hashed"
            )
