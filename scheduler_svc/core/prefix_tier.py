"""The prefix tier: prompt prefixes kept in the cache service, read by any instance.

A prompt's whole blocks fall into segments of `prefix_segment_blocks`; a
segment is one unpinned snapshot in the cache, named by its content:

    prompt blocks  |b0 b1 b2 b3|b4 b5 b6 b7|b8 b9        segment_blocks 4
    segments       [    s0     ][    s1     ]            b8, b9: no whole segment
    segment id     pfx-<xxh3_128(salt, chain hash of the segment's last block)>

The chain hash of a block names every token before it (kv_manager.py), so a
segment's id names the whole prefix up to its end; the salt names what else
decides its bytes (model and its weights, dtype, KV layout, block size) and
the segment's size in blocks, so no segment is ever read by another model or
layout, or as a segment of another size. Ids are the same on every instance
with the same segment size.

    write   through: once a prompt's prefill completes, each of its segments
            not known to be stored is copied out (`take_saves`: OffloadCommands
            with shared_prefix). Known stored: saved here since the request
            arrived (its lookup, the edge's, said the cache held no more: it may
            have evicted what was saved before; without an answer, saved here
            ever); none is sent while the cache does not answer
            (`cache_answers`), as its blocks would stay pinned until the copy
            timed out. back: its segments are only noted then, and
            copied out when the pool is about to evict them (`write_back`,
            each step: the oldest evictable blocks, while fewer blocks are
            free than one step may take; `before_evicting`, before any
            allocation that evicts more). Either way the save holds one more
            reference on the blocks, so they are never reused (nor their
            request's end waited for) until the copy lands (`finish_save`).
    read    at arrival the edge asks the cache which of the prompt's segments
            it holds (`segment_ids`), and the request carries the leading run
            found (Request.stored_segments). Admission (`plan_load`) takes the
            local prefix cache first, then, where the tier holds more and the
            cost model does not predict the load dearer than the prefill it
            saves, loads those segments into fresh blocks while the request
            is LOADING (lifecycle.py); whatever fails to load is prefilled.
            Nothing is loaded while the cache does not answer.

The restored blocks hold the bits the prefill would have written (the worker's
steps are batch-invariant), so outputs do not depend on where a prefix came from.

Why one file over 300 lines: reads, write-through and write-back share one
record of what was saved here and when, and one rule for what the cache is
known to hold; apart, each would keep its own and they would disagree.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from scheduler_svc.core.costs import CostModel
from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.core.outputs import Counters, OffloadCommand, PrefixLoad, RestoreCommand
from scheduler_svc.core.request import Request, RequestStatus

SEGMENT_ID_PREFIX = "pfx-"
# What a write-back save names as its request (the request may be long gone).
WRITE_BACK_REQUEST_ID = "prefix-tier-write-back"
# Segment ids remembered as saved here, so a prompt seen again before its
# lookup could know is not sent again; the oldest are forgotten first. A
# forgotten one sent again is refused as already stored, costing one put.
_MAX_KNOWN_STORED = 65536


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What admission loads: segments [first, end) of the prompt, after the
    local prefix's first `num_local_blocks` blocks, and the seconds the cost
    model predicted for reading them and for prefilling them (None: not yet
    measured). `declined`: predicted dearer than the prefill, so prefilled
    (counted once the request is admitted, not each step it waits)."""

    first: int
    end: int
    num_local_blocks: int
    load_s: float | None
    prefill_s: float | None
    declined: bool = False


@dataclass(frozen=True, slots=True)
class _Noted:
    """Write-back: a prefilled segment not yet saved, and what its blocks hold."""

    segment_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    since: float  # its request's arrival: when the cache did not hold it


class PrefixTier:
    def __init__(self, segment_blocks: int, salt: str, kv: KVCacheManager, costs: CostModel,
                 counters: Counters, clock: Callable[[], float],
                 write_back_below: int = 0) -> None:
        """`write_back_below`: 0 writes through; else free blocks below which
        the oldest evictable segments are written back. `clock`: the core's."""
        self.segment_blocks = segment_blocks
        # The segment's size too: an instance with other --prefix-segment-tokens
        # (same model, same cache) would read a segment of another size as its own.
        self._salt = xxhash.xxh3_128_digest(f"{salt}|{segment_blocks} blocks".encode())
        self._kv = kv
        self._costs = costs
        self._counters = counters
        # Saves in flight by segment id, with the blocks each holds a reference on.
        self.saves: dict[str, list[int]] = {}
        self._queued: list[OffloadCommand] = []
        # Segments saved here, by when (the clock), oldest first.
        self._stored: OrderedDict[str, float] = OrderedDict()
        self._clock = clock
        # The cache answered its latest probe (the engine reports it); until
        # it says otherwise, it is taken to.
        self.cache_answers = True
        self._write_back_below = write_back_below
        # Write-back: noted segments by each of their blocks.
        self._noted: dict[int, _Noted] = {}

    def segment_id(self, block_hash: int) -> str:
        """The id of the segment whose last block has `block_hash`."""
        return SEGMENT_ID_PREFIX + xxhash.xxh3_128_hexdigest(
            self._salt + block_hash.to_bytes(16, "little"))

    def segment_ids(self, block_hashes: Sequence[int]) -> list[str]:
        """The ids of the whole segments these block hashes (a prompt's) make up."""
        k = self.segment_blocks
        return [self.segment_id(block_hashes[i]) for i in range(k - 1, len(block_hashes), k)]

    # -- read ----------------------------------------------------------------

    def plan_load(self, req: Request, num_local_blocks: int) -> LoadPlan | None:
        """The segments to load for `req`, after `num_local_blocks` its local
        prefix cache holds (`declined` where the cost model predicts loading
        them dearer than prefilling them), or None: the tier holds no more.
        The last prompt token is always left to compute: it samples the first
        output. None while the cache does not answer (`cache_answers`): the
        load would only wait out its bound before the request prefilled."""
        if not self.cache_answers:
            return None
        k = self.segment_blocks
        block_size = self._kv.block_size
        end = min(req.stored_segments, (req.num_tokens - 1) // block_size // k)
        first = num_local_blocks // k
        if end <= first:
            return None
        num_blocks = (end - first) * k
        load_s = self._costs.restore_s(num_blocks)
        prefill_s = self._costs.prefill_s(first * k * block_size, end * k * block_size)
        declined = load_s is not None and prefill_s is not None and load_s >= prefill_s
        return LoadPlan(first, end, first * k, load_s, prefill_s, declined)

    def load(self, req: Request, plan: LoadPlan, load_id: str) -> PrefixLoad:
        """The reads of `plan` into `req`'s blocks (allocated for the whole
        prompt, its local prefix ending at segment `plan.first`)."""
        k = self.segment_blocks
        hashes = req.block_hashes
        blocks = req.block_ids
        return PrefixLoad(req.request_id, load_id, plan.first, [
            RestoreCommand(req.request_id, self.segment_id(hashes[(s + 1) * k - 1]),
                           blocks[s * k:(s + 1) * k], keep=True)
            for s in range(plan.first, plan.end)
        ], plan.load_s, plan.prefill_s)

    def tokens_of(self, segments: Sequence[RestoreCommand]) -> int:
        return sum(len(s.block_ids) for s in segments) * self._kv.block_size

    def finish_load(self, req: Request, load: PrefixLoad, num_loaded: int, num_bytes: int,
                    seconds: float | None) -> None:
        """Counts a load that landed its first `num_loaded` segments. Those
        after did not load (the cache lost them, or did not answer): they are
        prefilled, then saved again. A whole load's `seconds` teach the cost
        model what a read costs."""
        segments = load.segments
        counters = self._counters
        counters.bytes_tier_loaded += num_bytes
        if req.status is RequestStatus.FINISHED_ABORTED:
            return  # nothing it loaded is used; a load cut short by it did not fail
        num_tokens = self.tokens_of(segments[:num_loaded])
        counters.num_tier_hit_tokens += num_tokens
        if not req.output_token_ids:
            req.num_cached_tokens += num_tokens
        if num_loaded < len(segments):
            counters.num_tier_load_failures += 1
            req.stored_segments = load.first_segment + num_loaded
            for segment in segments[num_loaded:]:
                self._stored.pop(segment.snapshot_id, None)
        elif seconds is not None:
            self._costs.observe_restore(sum(len(s.block_ids) for s in segments), seconds)

    # -- write ---------------------------------------------------------------

    def on_prefilled(self, req: Request) -> None:
        """`req`'s prompt is prefilled: each of its segments not known stored
        nor being saved is saved now (write-through) or noted (write-back)."""
        if not self.cache_answers:
            return
        k = self.segment_blocks
        hashes = req.block_hashes
        # Known stored: saved since its lookup said otherwise; without an
        # answer, saved here ever (a segment the cache lost is sent again
        # after its next lookup).
        since = req.arrival_time if req.tier_answered else -math.inf
        for s in range(req.stored_segments, req.num_prompt_tokens // self._kv.block_size // k):
            segment_id = self.segment_id(hashes[(s + 1) * k - 1])
            if self._stored_since(segment_id, since) or segment_id in self.saves:
                continue
            block_ids = req.block_ids[s * k:(s + 1) * k]
            if not self._write_back_below:
                self._save(req.request_id, segment_id, block_ids)
                continue
            noted = _Noted(segment_id, tuple(block_ids), tuple(hashes[s * k:(s + 1) * k]), since)
            for block_id in block_ids:
                self._noted[block_id] = noted

    def write_back(self) -> None:
        """Write-back, at a step's start: while fewer blocks are free than one
        step may take, saves the noted segments among the next to be evicted."""
        self.before_evicting(self._write_back_below - self._kv.pool.num_free_blocks)

    def before_evicting(self, num_blocks: int) -> None:
        """Write-back: the pool is about to evict `num_blocks` cached blocks
        (KVCacheManager calls this before every allocation that would). Saves
        the noted segments among them first: a save holds its blocks, so the
        eviction takes the next ones in line, walked too until `num_blocks`
        blocks with nothing noted (or left to save) are counted. Where the
        saves leave too few blocks, the allocation waits for them to land."""
        noted = self._noted
        if num_blocks <= 0 or not noted or not self.cache_answers:
            return
        to_save: dict[str, _Noted] = {}
        for block_id in self._kv.pool.evictable_in_order():  # unchanged in the walk
            segment = noted.get(block_id)
            if segment is not None:
                if segment.segment_id in to_save:
                    continue  # a block of a segment about to be saved
                if self._worth_saving(segment):
                    to_save[segment.segment_id] = segment
                    continue
                self._forget(segment)  # evicted, or stored since
            num_blocks -= 1
            if num_blocks == 0:
                break
        for segment in to_save.values():
            self._forget(segment)
            self._save(WRITE_BACK_REQUEST_ID, segment.segment_id, list(segment.block_ids))

    def _forget(self, segment: _Noted) -> None:
        noted = self._noted
        for b in segment.block_ids:
            if noted.get(b) is segment:  # not a later segment's, in a block reused since
                del noted[b]

    def _worth_saving(self, segment: _Noted) -> bool:
        """Its blocks still hold what was noted, and no save has it or is on the way."""
        pool = self._kv.pool
        return (all(pool.block_hash(b) == h
                    for b, h in zip(segment.block_ids, segment.block_hashes, strict=True))
                and not self._stored_since(segment.segment_id, segment.since)
                and segment.segment_id not in self.saves)

    def num_saving(self) -> int:
        """Blocks only saves hold: evictable once those land. (A decode short
        of a block waits for them, as for an offload's, rather than preempt
        another: write-back pins exactly the blocks the pool was about to
        hand out.)"""
        pool = self._kv.pool
        return sum(pool.ref_cnt(b) == 1 for blocks in self.saves.values() for b in blocks)

    def _stored_since(self, segment_id: str, t: float) -> bool:
        """Saved here at or after `t` (-inf: ever; one never saved is not stored)."""
        saved = self._stored.get(segment_id)
        return saved is not None and saved >= t

    def _save(self, request_id: str, segment_id: str, block_ids: list[int]) -> None:
        self._kv.pool.touch(block_ids)
        self.saves[segment_id] = block_ids
        self._queued.append(OffloadCommand(
            request_id, segment_id, block_ids, len(block_ids) * self._kv.block_size,
            shared_prefix=True))

    def forget_blocks(self, kv_lost: bool) -> None:
        """The pool forgets what its blocks hold: so do the segments noted for
        write-back. Where the worker lost the blocks' KV (`kv_lost`), the saves
        not yet taken go too; else (an operator's flush) their blocks, held,
        still hold what they name, and they go out."""
        self._noted.clear()
        if kv_lost:
            pool = self._kv.pool
            for cmd in self.take_saves():
                pool.free(self.saves.pop(cmd.snapshot_id))

    def take_saves(self) -> list[OffloadCommand]:
        saves, self._queued = self._queued, []
        return saves

    def finish_save(self, cmd: OffloadCommand, num_bytes: int | None) -> None:
        """The segment is stored (num_bytes; 0: someone stored it first) or
        the copy failed (None); its blocks' references go back either way."""
        self._kv.pool.free(self.saves.pop(cmd.snapshot_id))
        if num_bytes is None:
            self._counters.num_tier_save_failures += 1
            return
        stored = self._stored
        stored[cmd.snapshot_id] = self._clock()
        stored.move_to_end(cmd.snapshot_id)
        if len(stored) > _MAX_KNOWN_STORED:
            stored.popitem(last=False)
        self._counters.num_tier_saves += 1
        self._counters.bytes_tier_saved += num_bytes
