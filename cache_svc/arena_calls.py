"""GetArena, PutShared and GetShared: the co-located path, where the client
moves a snapshot's bytes through the shared-memory arena itself (see
cache.proto and cache_svc.arena) and the call carries only the extent,
the checksums and the lease.

A shared put is header, extent, commit (with the checksums of what the
client wrote) or abandon; a shared get is open, extent with checksums, done.
The client holds its extent for at most shared_lease_s; a call that outlives
its lease, or whose client leaves, is aborted and leaves nothing behind. An
extent goes back at once only where a message came from the client after it
(a commit, even one refused, or `abandon`, which a client that gives up
sends): it writes no more. Otherwise (its lease or deadline ran out, it
cancelled, its channel closed, its process went; grpc reads each of these as
the end of the request stream) a copy into it may still run, on a thread or
a DMA engine, so it is quarantined for one more lease, still counted against
the budget, before any other put gets it. A client that names the arena it
maps (call metadata ARENA_ID_KEY) and maps another one (this cache restarted
since it asked GetArena) is refused with FAILED_PRECONDITION before any room
is taken, to re-attach. Mixed into `cache_svc.server.CacheServicer`, which
sets the fields declared below.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from cache_svc.arena import Arena
from cache_svc.convert import info_to_proto, meta_from_proto, meta_to_proto
from cache_svc.metrics import TransferMetrics
from cache_svc.model import Buffer
from cache_svc.store import SnapshotStore
from kvstash import errors
from kvstash.cache_sdk.shared_arena import ARENA_ID_KEY
from kvstash.common import rpc_errors
from kvstash.v1 import cache_pb2, cache_pb2_grpc


class ArenaCalls(cache_pb2_grpc.KVCacheServicer):
    """The co-located RPCs of `CacheServicer`; its __init__ sets these fields."""

    _store: SnapshotStore
    _metrics: TransferMetrics

    @rpc_errors.maps_errors
    async def GetArena(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        arena = self._store.arena
        if arena is None:
            return cache_pb2.ArenaInfo()
        return cache_pb2.ArenaInfo(path=str(arena.path), size_bytes=arena.size,
                                   arena_id=arena.arena_id)

    @rpc_errors.maps_errors
    async def PutShared(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        started = time.perf_counter()
        store = self._store
        requests = aiter(request_iterator)
        try:
            # The first message is read before anything is refused: a client
            # whose write of it met a call already ended would learn only
            # grpc's internal error, not why.
            header = await self._expect(requests, "header", "shared put")
            arena = self._arena(context)
            meta = meta_from_proto(header, store.config.default_ttl_s)
            await store.reserve_put(meta)
        except errors.KvstashError as exc:
            await rpc_errors.abort_with(context, exc)
        try:
            session = store.begin_put(meta)
        except BaseException:
            store.release_put(meta)
            raise
        committed = False
        writing = True  # the client may still write its extent
        what = f"put of {errors.preview(meta.snapshot_id)}"
        try:
            yield cache_pb2.PutSharedResponse(extent=self._extent(arena, session.buffer))
            request = await self._next_request(requests, what, lease=True)
            writing = request is None
            if request is not None and request.HasField("abandon"):
                return
            commit = _field(request, "commit", what)
            info = store.commit_shared_put(session, list(commit.checksums))
            committed = True
            yield cache_pb2.PutSharedResponse(info=info_to_proto(info))
        except errors.KvstashError as exc:
            await rpc_errors.abort_with(context, exc)
        finally:
            if not committed:  # the client failed, left, or ran out of lease
                quarantine_s = store.config.shared_lease_s if writing else 0.0
                await store.abort_put(session, quarantine_s)
        self._metrics.put_seconds.observe(time.perf_counter() - started)

    @rpc_errors.maps_errors
    async def GetShared(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        started = time.perf_counter()
        reads = self._store.reads
        requests = aiter(request_iterator)
        try:
            request = await self._expect(requests, "open", "shared get")  # as in PutShared
            arena = self._arena(context)
            if request.start_chunk:
                raise errors.InvalidArgument("a shared get reads the whole snapshot: "
                                             f"start_chunk is {request.start_chunk}, must be 0")
            reader = await reads.open_shared_reader(request.snapshot_id, request.consume)
        except errors.KvstashError as exc:
            await rpc_errors.abort_with(context, exc)
        finished = False
        try:
            entry = reader.entry
            assert entry.buffer is not None
            yield cache_pb2.GetSharedResponse(header=meta_to_proto(reader.meta),
                                              extent=self._extent(arena, entry.buffer),
                                              checksums=entry.checksums)
            await self._expect(requests, "done",
                               f"get of {errors.preview(reader.meta.snapshot_id)}", lease=True)
            finished = True
        except errors.KvstashError as exc:
            await rpc_errors.abort_with(context, exc)
        finally:
            reads.close_reader(reader, finished)
        self._metrics.get_seconds.observe(time.perf_counter() - started)

    def _arena(self, context: grpc.aio.ServicerContext) -> Arena:
        """This cache's arena, which must be the one the client maps."""
        arena = self._store.arena
        if arena is None:
            raise errors.FailedPrecondition(
                "this cache has no arena (start it with --arena-dir); use PutSnapshot and "
                "GetSnapshot")
        mapped = next((value for key, value in context.invocation_metadata() or ()
                       if key == ARENA_ID_KEY), None)
        if mapped is not None and mapped != arena.arena_id:
            raise errors.FailedPrecondition(
                f"the client maps arena {errors.preview(str(mapped))}, this cache's is "
                f"{arena.arena_id} (it restarted): re-attach (GetArena) and retry")
        return arena

    async def _expect(self, requests: Any, field: str, what: str, lease: bool = False) -> Any:
        """The next request (see `_next_request`), which must be the `field` kind."""
        return _field(await self._next_request(requests, what, lease), field, what)

    async def _next_request(self, requests: Any, what: str, lease: bool) -> Any:
        """The next request, None once the client closed its side, within the
        shared lease: the one the client's extent is held for (`lease`), or,
        for a call's first message, so that a silent client does not keep a
        call."""
        step = anext(requests, None)
        lease_s = self._store.config.shared_lease_s
        try:
            async with asyncio.timeout(lease_s):
                request = await step
        except TimeoutError:
            held = "held its extent longer than" if lease else "sent nothing within"
            raise errors.DeadlineExceeded(
                f"{what}: the client {held} the {lease_s:g} s lease") from None
        return request

    def _extent(self, arena: Arena, buffer: Buffer) -> cache_pb2.Extent:
        offset, length = self._store.extent_of(buffer)
        return cache_pb2.Extent(arena_id=arena.arena_id, offset=offset, length=length)


def _field(request: Any, field: str, what: str) -> Any:
    """`request`'s `field`, which must be its kind (None: the client closed its side)."""
    if request is None or not request.HasField(field):
        raise errors.InvalidArgument(f"{what}: expected a {field} message")
    return getattr(request, field)
