"""KVCacheManager: per-request block tables on top of the BlockPool.

Check-then-act, as in nano-vllm: `allocate_slots` returns None (and changes
nothing) when the pool cannot cover the request plus what the caller asks to
keep back. Prefix caching: a block is registered under its prefix hash only
once its KV has been computed (`cache_full_blocks`, called after a step), so
a prefix hit always finds valid KV.

    prompt + output  |aaaa|bbbb|cccc|dd    block_size 4
    block_hashes      h0   h1   h2         h_i = H(h_{i-1}, tokens of block i)
    prefix hit        stops before the block holding the last token, which
                      must be computed to sample the next one
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from itertools import islice

import xxhash

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.kv_events import BlockStored
from scheduler_svc.core.request import Request

ROOT_HASH = 0


def chain_hashes(parent_hash: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """The 128-bit prefix hash of each whole block of `token_ids`, chained from
    `parent_hash` (collisions would silently serve another prompt's KV):

        h_i = xxh3_128(h_{i-1} as 16 bytes little-endian + block i as uint32s)

    The tokens are packed once, not block by block: a long prompt's blocks
    cost a slice and a hash each."""
    data = array("I", token_ids).tobytes()
    width = 4 * block_size
    hashes = []
    for start in range(0, len(data) - width + 1, width):
        parent_hash = xxhash.xxh3_128_intdigest(
            parent_hash.to_bytes(16, "little") + data[start:start + width])
        hashes.append(parent_hash)
    return hashes


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        # Told how many cached blocks an allocation is about to evict, before
        # it checks what it can take (the prefix tier's write-back saves them
        # first, holding them); None: nobody.
        self.before_evicting: Callable[[int], None] | None = None

    def _make_room(self, num_blocks: int) -> None:
        """About to allocate `num_blocks`: tells `before_evicting` what that evicts."""
        num_evicted = num_blocks - self.pool.num_free_blocks
        if num_evicted > 0 and self.before_evicting is not None:
            self.before_evicting(num_evicted)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ensure_block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        hashes = req.block_hashes
        have, size = len(hashes), self.block_size
        if have < num_blocks:
            hashes += chain_hashes(hashes[-1] if hashes else ROOT_HASH,
                                   req.token_ids(have * size, num_blocks * size), size)
        return hashes

    def find_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding the longest computed prefix of req's tokens."""
        max_blocks = (req.num_tokens - 1) // self.block_size
        if max_blocks == 0:
            return []
        return self.pool.cached_run(islice(self._ensure_block_hashes(req, max_blocks), max_blocks))

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        prefix_block_ids: Sequence[int] = (),
        num_reserved_blocks: int = 0,
    ) -> list[int] | None:
        """Grows req's block table to cover num_computed + prefix + num_new_tokens.

        `prefix_block_ids` (from `find_prefix`, only for a request holding no
        blocks) are taken as computed. Returns the newly allocated block ids,
        or None if fewer than `num_reserved_blocks` allocatable blocks would
        be left afterwards.
        """
        pool = self.pool
        num_prefix_tokens = len(prefix_block_ids) * self.block_size
        num_needed = self.num_blocks_for(
            req.num_computed_tokens + num_prefix_tokens + num_new_tokens
        ) - len(req.block_ids) - len(prefix_block_ids)
        # Evictable prefix blocks stop being allocatable once taken.
        num_evictable_hits = pool.num_unreferenced(prefix_block_ids)
        self._make_room(num_needed + num_evictable_hits)
        if num_needed + num_evictable_hits + num_reserved_blocks > pool.num_allocatable_blocks:
            return None
        if prefix_block_ids:
            if req.block_ids:
                raise ValueError(f"request {req.request_id} already holds blocks")
            pool.touch(prefix_block_ids)
            req.block_ids.extend(prefix_block_ids)
            req.num_computed_tokens = num_prefix_tokens
            req.num_cached_blocks = len(prefix_block_ids)
        new_ids = pool.allocate(num_needed) if num_needed > 0 else []
        req.block_ids.extend(new_ids)
        return new_ids

    def append_block(self, req: Request) -> bool:
        """One more block for a decode that filled its last; False (no change) if none is left."""
        pool = self.pool
        self._make_room(1)
        if not pool.can_allocate(1):
            return False
        req.block_ids.extend(pool.allocate(1))
        return True

    def allocate_fresh(self, req: Request, num_blocks: int) -> list[int] | None:
        """A new block table of `num_blocks` uncached blocks (restore target)."""
        if req.block_ids:
            raise ValueError(f"request {req.request_id} already holds blocks")
        self._make_room(num_blocks)
        if not self.pool.can_allocate(num_blocks):
            return None
        req.block_ids = self.pool.allocate(num_blocks)
        req.num_cached_blocks = 0
        return req.block_ids

    def cache_full_blocks(self, req: Request) -> None:
        """Registers req's blocks whose every position now has computed KV."""
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        start = req.num_cached_blocks
        if num_full <= start:
            return
        hashes = self._ensure_block_hashes(req, num_full)
        pool = self.pool
        block_ids = req.block_ids
        events = pool.events
        for i in range(start, num_full):
            # Duplicate prefix (computed twice concurrently): the block stays uncached.
            if pool.cache_block(block_ids[i], hashes[i]) and events is not None:
                size = self.block_size
                events.append(BlockStored(hashes[i], hashes[i - 1] if i else None,
                                          tuple(req.token_ids(i * size, (i + 1) * size))))
        req.num_cached_blocks = num_full

    def num_exclusive_blocks(self, req: Request) -> int:
        """Blocks freeing req would release (not shared with another request)."""
        return self.pool.count_exclusive(req.block_ids)

    def free(self, req: Request) -> None:
        """Releases req's blocks; its cached full blocks stay reusable (evictable)."""
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0
