"""The prefix cache's events (core/kv_events.py) as numbered KvEventBatch
messages, for every SubscribeKvEvents stream.

    engine, after each step ──publish(events)──▶ hub ──▶ one queue per subscriber
                                                  └──▶ the last `keep` batches, replayed
                                                       to a subscriber that resumes

Batches are numbered 1, 2, 3, ... (a gateway notices a gap, or a restart
from 1, and clears its index). A subscriber too slow to keep `keep` batches
queued is dropped: it reconnects and resumes from its last number.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator

from smg_grpc_proto.generated import common_pb2

from scheduler_svc.core.kv_events import BlockRemoved, BlockStored, KvEvent

_INT64 = (1 << 63) - 1


def _int64(block_hash: int) -> int:
    """Our 128-bit prefix hashes as the protocol's int64 block ids (routers
    match on tokens; the id only names a block)."""
    return block_hash & _INT64


def to_proto(event: KvEvent, event_id: int, block_size: int) -> common_pb2.KvCacheEvent:
    if isinstance(event, BlockStored):
        stored = common_pb2.KvBlocksStored(blocks=[common_pb2.KvBlock(
            block_hash=_int64(event.block_hash), token_ids=event.token_ids,
            block_size=block_size)])
        if event.parent_hash is not None:
            stored.parent_block_hash = _int64(event.parent_hash)
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlockRemoved):
        return common_pb2.KvCacheEvent(event_id=event_id, removed=common_pb2.KvBlocksRemoved(
            block_hashes=[_int64(event.block_hash)]))
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


class KvEventHub:
    def __init__(self, block_size: int, keep: int = 1024) -> None:
        self._block_size = block_size
        self._recent: deque[common_pb2.KvEventBatch] = deque(maxlen=keep)
        self._keep = keep
        self._subscribers: set[asyncio.Queue[common_pb2.KvEventBatch | None]] = set()
        self._sequence = 0
        self._event_id = 0

    @property
    def sequence_number(self) -> int:
        """The number of the latest batch (0: none yet)."""
        return self._sequence

    def publish(self, events: list[KvEvent]) -> None:
        if not events:
            return
        self._sequence += 1
        protos = []
        for event in events:
            self._event_id += 1
            protos.append(to_proto(event, self._event_id, self._block_size))
        batch = common_pb2.KvEventBatch(sequence_number=self._sequence, timestamp=time.time(),
                                        events=protos)
        self._recent.append(batch)
        for queue in list(self._subscribers):
            if queue.qsize() >= self._keep:
                self._subscribers.discard(queue)
                queue.put_nowait(None)  # too slow: ends its stream
            else:
                queue.put_nowait(batch)

    async def subscribe(self, after: int = 0) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Batches numbered above `after` still kept, then every new one."""
        queue: asyncio.Queue[common_pb2.KvEventBatch | None] = asyncio.Queue()
        for batch in self._recent:
            if batch.sequence_number > after:
                queue.put_nowait(batch)
        self._subscribers.add(queue)
        try:
            while (batch := await queue.get()) is not None:
                yield batch
        finally:
            self._subscribers.discard(queue)
