"""What happens to the prefix cache, as events a gateway's cache-aware router
follows (VllmEngine.SubscribeKvEvents):

    BlockStored    a full block's KV is computed and cached under its hash
                   (with its parent's hash and its tokens: routers match on tokens)
    BlockRemoved   a cached block was evicted for reuse
    CacheCleared   every cached prefix was forgotten (the worker restarted, a flush)

The block pool and KV manager append them to a `KvEventLog` while one is
attached (`Scheduler.record_kv_events`), and the engine takes them after
every step. Without a log nothing is recorded and nothing costs anything.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hash: int
    parent_hash: int | None  # None: the first block of a sequence
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hash: int


@dataclass(frozen=True, slots=True)
class CacheCleared:
    pass


KvEvent = BlockStored | BlockRemoved | CacheCleared


class KvEventLog:
    """Events since the last `take`."""

    def __init__(self) -> None:
        self._events: list[KvEvent] = []

    def append(self, event: KvEvent) -> None:
        self._events.append(event)

    def take(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events
