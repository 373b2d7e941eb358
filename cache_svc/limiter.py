"""A byte-counting semaphore that bounds chunk payload in flight over all streams.

A put takes its share when it is admitted and keeps it to its end (what gRPC
may hold for it then; see cache_svc.put_stream); a get takes one before it
reads each chunk and gives it back once gRPC has sent it. While a put waits
here it is not admitted, so its client's data stays in gRPC's flow-controlled
window and HTTP/2 slows the sender instead of the server buffering more.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class ByteLimiter:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    async def acquire(self, num_bytes: int) -> None:
        if num_bytes > self.capacity:
            raise ValueError(f"asked for {num_bytes} bytes, limiter holds {self.capacity}")
        if not self._waiters and self.in_use + num_bytes <= self.capacity:
            self.in_use += num_bytes
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (num_bytes, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(num_bytes)  # granted just as we were cancelled
            else:
                with contextlib.suppress(ValueError):  # _wake may have dropped it
                    self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, num_bytes: int) -> None:
        self.in_use -= num_bytes
        self._wake()

    def _wake(self) -> None:
        # FIFO: a large request is not starved by a stream of small ones. A
        # waiter cancelled before its task ran again is dropped, not granted.
        while self._waiters:
            num_bytes, fut = self._waiters[0]
            if not fut.done() and self.in_use + num_bytes > self.capacity:
                return
            self._waiters.popleft()
            if not fut.done():
                self.in_use += num_bytes
                fut.set_result(None)

    @contextlib.asynccontextmanager
    async def hold(self, num_bytes: int) -> AsyncIterator[None]:
        await self.acquire(num_bytes)
        try:
            yield
        finally:
            self.release(num_bytes)


class BandwidthLimiter:
    """Paces chunk payload to `bytes_per_s`, shared by every stream of the service.

    A token bucket without burst, kept as a virtual clock: each `take(n)`
    books the next n / rate seconds of the link after all earlier bookings and
    returns when its booking ends. One stream sending chunks of n bytes is
    released at n/rate, 2n/rate, ..., so N bytes take at least N / rate
    seconds; concurrent streams share the rate first come, first served.

        now      booked_until                       end = start + n / rate
         |------------|===== earlier bookings =====|---- this take ----|
                                                  start               returns

    Callers take *before* pulling a chunk out of gRPC (put) or reading it
    (get), so a paced stream waits with its bytes still in HTTP/2's
    flow-controlled window: nothing is buffered beyond the in-flight bounds.
    Waiting is `asyncio.sleep`; the event loop never blocks. A rate of 0 means
    unlimited, and `take` returns at once.
    """

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s < 0:
            raise ValueError(f"bytes_per_s is {bytes_per_s}, must be >= 0")
        self.bytes_per_s = bytes_per_s
        self._booked_until = 0.0  # event-loop time at which the last booking ends

    async def take(self, num_bytes: int) -> None:
        if not self.bytes_per_s or num_bytes <= 0:
            return  # nothing to pace: not made to wait behind others' bookings
        now = asyncio.get_running_loop().time()
        start = max(now, self._booked_until)
        end = start + num_bytes / self.bytes_per_s
        self._booked_until = end
        try:
            await asyncio.sleep(end - now)
        except asyncio.CancelledError:
            if self._booked_until == end:  # nobody booked after us: give the time back
                self._booked_until = start
            raise
