"""The cache client's co-located path: PutShared and GetShared, the bytes
moving through the cache's arena mapped into this process
(kvstash.cache_sdk.shared_arena), gRPC carrying only control.

    put:  header --> extent <-- write(extent) fills it --> commit(checksums) --> info
    get:  open --> extent + checksums, verified --> read(...) uses it --> done

The arena is asked for once (GetArena), again after a call found it
changed, and every _REMAP_AFTER_S while there is none to map: every call
names the arena it uses (metadata ARENA_ID_KEY), and FailedPrecondition
(the cache restarted with another arena, has none now, or the snapshot is
only on disk) makes a call answer None, for the caller to stream instead
(kvstash.cache_sdk.streamed_calls), and the next call
re-attaches; Unavailable is raised. An extent is leased to its call, so the
call is never ended, giving the extent back to the cache, while this process
still touches it (`_to_the_end`); a put given up then says so (`abandon`),
and the cache frees the extent at once (`_let_go`). A put's call ended
otherwise (cancelled, its channel closed, its process gone) leaves its
extent quarantined for a lease (cache_svc.arena_calls).

Why one file (a little over 300 lines): put and get share the arena's
attachment, the lease and the stream helpers below, which nothing else uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc._cython.cygrpc import ExecuteBatchError

from kvstash import errors
from kvstash.cache_sdk import refusals
from kvstash.cache_sdk.chunk_codec import check_received_header
from kvstash.cache_sdk.shared_arena import (
    ARENA_ID_KEY,
    SharedArena,
    chunk_checksums,
    verify_chunks,
)
from kvstash.cache_sdk.streamed_calls import half_close
from kvstash.common import rpc_errors
from kvstash.v1 import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
# How long an arena that could not be mapped here, or a cache that has none,
# is not asked again: the failure may pass (a file descriptor limit, memory),
# or may not (another host); the cache may restart with an arena.
_REMAP_AFTER_S = 60.0
# How long a put given up waits for the cache to take its `abandon`, which
# frees its extent at once; cut short, the call is cancelled and the cache
# quarantines the extent instead.
_LET_GO_S = 5.0


class Lease:
    """Whether a shared put's call still holds its extent. Once the call has
    ended (its lease ran out, its deadline passed, the cache went away) the
    extent is another put's after a quarantine of one lease, so a copy queued
    behind other work checks before it starts. Thread-safe."""

    def __init__(self) -> None:
        self._ended = threading.Event()

    def end(self) -> None:
        self._ended.set()

    def check(self, what: str) -> None:
        """Unavailable, naming `what`, once the call has ended."""
        if self._ended.is_set():
            raise errors.Unavailable(f"{what}: the cache ended the call before the copy began")


# A put's filler: `write(extent, lease)` fills the extent, `lease.check()`
# before each copy into it, and may return its chunks' checksums.
Write = Callable[[memoryview, Lease], Awaitable[list[int] | None]]


class ArenaCalls:
    """The arena as mapped here, and the shared calls that use it. Each
    `timeout_s` is the call's deadline as CacheClient resolved it (None = none)."""

    def __init__(self, stub: cache_pb2_grpc.KVCacheStub, address: str) -> None:
        self._stub = stub
        self._address = address  # for the log line when the arena cannot be mapped
        self._arena: SharedArena | None = None
        # Event-loop time from which GetArena is asked again: at once at first
        # and after a call found the arena changed, _REMAP_AFTER_S after a
        # failed mapping or an answer of none, else never.
        self._ask_after = 0.0
        self._unmapped_id: str | None = None  # the arena last failed to map (logged once)
        self._arena_lock = asyncio.Lock()

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    async def arena(self, timeout_s: float | None) -> SharedArena | None:
        """The cache's arena mapped here, or None where it has none or this
        process cannot map it."""
        try:
            async with asyncio.timeout(timeout_s):  # one GetArena for many concurrent calls
                await self._arena_lock.acquire()
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"cache {self._address}: its arena not known within the call's {timeout_s:g} s "
                "deadline (another call's GetArena)") from None
        try:
            if asyncio.get_running_loop().time() >= self._ask_after:
                await self._ask_arena(timeout_s)
        finally:
            self._arena_lock.release()
        return self._arena

    async def _ask_arena(self, timeout_s: float | None) -> None:
        request = cache_pb2.GetArenaRequest()
        try:
            info = await refusals.unary(
                lambda left: self._stub.GetArena(request, timeout=left), timeout_s,
                "cache: GetArena")
        except errors.Unimplemented:
            info = cache_pb2.ArenaInfo()  # a cache that predates the arena
        if self._arena is not None and self._arena.arena_id != info.arena_id:
            self._arena.close()
            self._arena = None
        now = asyncio.get_running_loop().time()
        ask_after = math.inf if info.path else now + _REMAP_AFTER_S
        if info.path and self._arena is None:
            try:
                self._arena = await asyncio.to_thread(SharedArena, info)
            except (OSError, ValueError) as exc:
                level = logging.DEBUG if info.arena_id == self._unmapped_id else logging.INFO
                log.log(level, "cache %s: its arena %s cannot be mapped here (%s); streaming "
                        "over gRPC", self._address, info.path, exc)
                self._unmapped_id = info.arena_id
                ask_after = now + _REMAP_AFTER_S
        self._ask_after = ask_after

    async def put(
        self, arena: SharedArena, header: cache_pb2.SnapshotHeader,
        write: Write, timeout_s: float | None,
    ) -> int | None:
        """Puts through `arena` (this client's `arena()`): `write(extent,
        lease)` fills the extent (see Lease) and may return its chunks'
        checksums (else computed here), then the put is committed. Returns
        the bytes stored, or None where the cache has no arena now."""
        call = self._stub.PutShared(timeout=timeout_s, metadata=_naming(arena))
        lease = Lease()
        call.add_done_callback(lambda _: lease.end())
        extent_out = False  # the cache handed out an extent (see _let_go)
        try:
            await _write(call, cache_pb2.PutSharedRequest(header=header), header.snapshot_id,
                         first=True)
            try:
                reply = await _next(call, header.snapshot_id)
            except errors.FailedPrecondition:  # another arena, or none now: stream
                self._ask_after = 0.0
                call.cancel()
                return None
            extent_out = True
            extent = _view(arena, reply.extent, header.total_bytes,
                           f"put of {header.snapshot_id}")
            sums = await _to_the_end(write(extent, lease))
            if sums is None:
                sums = await _to_the_end(
                    asyncio.to_thread(chunk_checksums, extent, header.chunk_bytes))
            del extent
            commit = cache_pb2.SharedPutCommit(checksums=sums)
            await _write(call, cache_pb2.PutSharedRequest(commit=commit), header.snapshot_id)
            response = await _next(call, header.snapshot_id)
            await half_close(call)
            await _finish(call)
        except refusals.Refused:  # nothing done: the arena has not changed
            call.cancel()
            raise
        except errors.Unavailable:
            self._ask_after = 0.0  # it may have changed: ask again next time
            await _let_go(call, extent_out, header.snapshot_id)
            raise
        except BaseException:
            await _let_go(call, extent_out, header.snapshot_id)
            raise
        return int(response.info.header.total_bytes)

    async def get(
        self, arena: SharedArena, snapshot_id: str,
        read: Callable[[cache_pb2.SnapshotHeader, memoryview, list[int]], Awaitable[None]],
        consume: bool, timeout_s: float | None, verified_by_read: bool,
    ) -> cache_pb2.SnapshotHeader | None:
        """Gets through `arena`: the extent's chunks are verified (unless
        `verified_by_read`), then `read(header, extent, checksums)` uses it.
        None where the snapshot is only on disk or the cache has no arena now."""
        call = self._stub.GetShared(timeout=timeout_s, metadata=_naming(arena))
        what = f"snapshot {snapshot_id}"
        try:
            request = cache_pb2.GetSnapshotRequest(snapshot_id=snapshot_id, consume=consume)
            await _write(call, cache_pb2.GetSharedRequest(open=request), snapshot_id, first=True)
            try:
                response = await _next(call, snapshot_id)
            except errors.FailedPrecondition:  # on disk, another arena, or none now
                self._ask_after = 0.0
                return None
            header = response.header
            check_received_header(header, what)
            extent = _view(arena, response.extent, header.total_bytes, what)
            checksums = list(response.checksums)
            if not verified_by_read:
                await _to_the_end(asyncio.to_thread(
                    verify_chunks, extent, header.chunk_bytes, checksums, what))
            await _to_the_end(read(header, extent, checksums))
            del extent
            await _write(call, cache_pb2.GetSharedRequest(done=cache_pb2.SharedGetDone()),
                         snapshot_id)
            await half_close(call)
            await _finish(call)
        except refusals.Refused:
            raise
        except errors.Unavailable:
            self._ask_after = 0.0
            raise
        finally:
            call.cancel()  # no-op once finished
        return header


def _naming(arena: SharedArena) -> tuple[tuple[str, str], ...]:
    return ((ARENA_ID_KEY, arena.arena_id),)


def _view(arena: SharedArena, extent: cache_pb2.Extent, total_bytes: int, what: str
          ) -> memoryview:
    """The bytes of the extent the cache named for `total_bytes`."""
    if extent.length != total_bytes:
        raise errors.DataLoss(f"{what}: the cache named an extent of {extent.length} bytes "
                              f"for {total_bytes}")
    return arena.view(extent)


async def _read(call: Any) -> Any:
    """The next message of a shared call, or EOF; its error status, raised.
    grpc raises CancelledError for a call cancelled here, this client closed
    under it: Unavailable, unless this task is the one being cancelled."""
    try:
        return await call.read()
    except grpc.aio.AioRpcError as exc:
        raise refusals.error_from_rpc(exc) from None
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise errors.Unavailable("cache call cancelled: its client was closed") from None


async def _next(call: Any, snapshot_id: str) -> Any:
    """The next response of a shared call; its error status, raised."""
    response = await _read(call)
    if response is grpc.aio.EOF:
        raise errors.Unavailable(f"cache ended the call on {snapshot_id} early")
    return rpc_errors.decoded(response, f"cache: a reply on {snapshot_id}")


async def _write(call: Any, request: Any, snapshot_id: str, first: bool = False) -> None:
    """Sends `request` (the call's `first`?); where the cache has ended the
    call already (a lease run out, a restart, a refusal), how it ended,
    raised: Unavailable if it said nothing (not grpc's InvalidStateError,
    which callers would take for a bug)."""
    try:
        await call.write(request)
    except grpc.aio.AioRpcError as exc:
        raise refusals.error_from_rpc(exc, unsent=first) from None
    except (asyncio.InvalidStateError, ExecuteBatchError):
        await _finish(call)
        raise errors.Unavailable(f"cache ended the call on {snapshot_id} early") from None


async def _finish(call: Any) -> None:
    """Waits for a shared call's status; raises it unless OK."""
    extra = await _read(call)
    if extra is not grpc.aio.EOF:
        raise errors.DataLoss(f"cache sent an unexpected message: {type(extra).__name__}")


async def _let_go(call: Any, extent_out: bool, snapshot_id: str) -> None:
    """Ends a put that will not commit. Where the cache handed out an extent,
    which this process no longer writes (`_to_the_end`), `abandon` says so,
    and the cache frees it at once; a call cancelled instead (here when
    cancelled again, or after _LET_GO_S) it quarantines for a lease."""
    try:
        if extent_out and not call.done():
            abandon = cache_pb2.PutSharedRequest(abandon=cache_pb2.SharedPutAbandon())
            with contextlib.suppress(TimeoutError, errors.KvstashError):
                async with asyncio.timeout(_LET_GO_S):
                    await _write(call, abandon, snapshot_id)
                    await call.code()  # the cache has read it: cancelling cannot overtake it
    finally:
        call.cancel()  # no-op once ended


async def _to_the_end(step: Awaitable[T]) -> T:
    """Awaits `step`; if the caller is cancelled meanwhile, even more than
    once, still lets it finish (a copy on a thread cannot be stopped) before
    the cancellation goes on. So a shared call never ends, giving its extent
    back to the cache, while this process still touches the extent."""
    task = asyncio.ensure_future(step)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        if not task.cancelled():
            task.exception()  # retrieved: the caller sees the cancellation
        raise cancelled
    return task.result()
