"""The request side of one PutSnapshot call: what it asks gRPC for, when, and
the share of the in-flight budget that bounds what gRPC holds for it.

What grpc core (1.85, with cache_svc.server.SERVER_OPTIONS) holds for a put
stream, measured with clients that send payload without waiting:

  - until the servicer asks for a message: the initial window
    (STREAM_WINDOW_BYTES), whatever the client sends;
  - once it asked: that message, and, once it has read one, about one more
    message of the same size that gRPC lets the client send ahead.

So a put that is being read may have three chunks out of its client at once:

    chunk k: being copied   chunk k+1: asked for   chunk k+2: sent ahead
    (Python bytes)          (gRPC's buffers)       (gRPC's buffers)

and holds PUT_SHARE_CHUNKS chunks of max_inflight_bytes from admission to its
end; a put not admitted yet (only its header was read) holds none. A put read
out after a refusal or failure (the servicer's drain) holds at least
DRAIN_SHARE_BYTES: one message of any size gRPC accepts, and one ahead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from cache_svc.config import PUT_SHARE_CHUNKS
from cache_svc.limiter import BandwidthLimiter, ByteLimiter
from cache_svc.snapshot import SnapshotMeta
from kvstash.cache_sdk.chunk_codec import ADMITTED_KEY, MAX_CHUNK_BYTES
from kvstash.errors import DeadlineExceeded

DRAIN_SHARE_BYTES = 2 * MAX_CHUNK_BYTES


def put_share_bytes(meta: SnapshotMeta) -> int:
    """In-flight budget an admitted put holds (an honest client never has more
    than its whole snapshot out at once)."""
    return min(PUT_SHARE_CHUNKS * meta.chunk_bytes, meta.total_bytes)


class PutStream:
    """One put's request stream. Payload is asked for one message ahead of the
    copy, so chunk k+1 crosses the network while chunk k is copied; each
    message is paced (BandwidthLimiter) before it is asked for."""

    def __init__(self, requests: Any, context: grpc.aio.ServicerContext,
                 limiter: ByteLimiter, bandwidth: BandwidthLimiter, idle_s: float) -> None:
        self._requests = requests
        self._idle_s = idle_s  # longest wait for the client's next message
        self._context = context
        self._limiter = limiter
        self._bandwidth = bandwidth
        self._share = 0  # bytes of the in-flight budget held until `close`
        self._ahead: asyncio.Task[Any] | None = None  # the message asked for
        self._metadata_sent = False
        self.ended = False  # the client half-closed

    async def next(self) -> Any:
        """The next message, asked for now and not paced (the header)."""
        async with self._idle_limit():
            request = await anext(self._requests, None)
        self.ended = request is None
        return request

    @contextlib.asynccontextmanager
    async def _idle_limit(self) -> AsyncIterator[None]:
        """DeadlineExceeded when the client sends nothing for idle_s: a put
        that stalls (a slow-loris) must not hold its reservation for ever."""
        try:
            async with asyncio.timeout(self._idle_s):
                yield
        except TimeoutError:
            raise DeadlineExceeded(
                f"the client sent nothing for {self._idle_s:g} s; put abandoned") from None

    async def hold(self, num_bytes: int) -> None:
        """Holds at least `num_bytes` of the in-flight budget until `close`,
        waiting for what it does not hold yet."""
        if num_bytes > self._share:
            await self._limiter.acquire(num_bytes - self._share)
            self._share = num_bytes

    @property
    def reading(self) -> bool:
        return self._ahead is not None

    async def read_ahead(self, pace_bytes: int) -> None:
        """Asks for the next message once `pace_bytes` of payload may pass."""
        self._ahead = asyncio.ensure_future(self._paced_next(pace_bytes))
        await asyncio.sleep(0)  # lets it ask gRPC now, before the caller copies

    async def _paced_next(self, pace_bytes: int) -> Any:
        await self._bandwidth.take(pace_bytes)
        return await self.next()

    async def take(self) -> Any:
        """The message asked for by `read_ahead`; None once the client is done."""
        assert self._ahead is not None
        async with self._idle_limit():
            request = await asyncio.shield(self._ahead)
        self._ahead = None  # only now: if cancelled meanwhile, `close` ends it
        return request

    async def send_metadata(self, admitted: bool) -> None:
        if not self._metadata_sent:
            self._metadata_sent = True
            await self._context.send_initial_metadata(((ADMITTED_KEY, "1"),) if admitted else ())

    async def close(self) -> None:
        """Stops a read still in progress and gives back the share."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.cancel()
            await asyncio.wait((ahead,))
        self._limiter.release(self._share)
        self._share = 0
