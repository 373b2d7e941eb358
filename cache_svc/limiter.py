"""A byte-counting semaphore that bounds chunk payload in flight over all streams.

A stream takes its share before it pulls the next chunk out of gRPC and gives
it back once the chunk is copied (put) or written (get). While a stream waits
here its data stays in gRPC's flow-controlled window, so the sender is slowed
by HTTP/2 instead of the server buffering more.
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
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, num_bytes: int) -> None:
        self.in_use -= num_bytes
        self._wake()

    def _wake(self) -> None:
        # FIFO: a large request is not starved by a stream of small ones.
        while self._waiters and self.in_use + self._waiters[0][0] <= self.capacity:
            num_bytes, fut = self._waiters.popleft()
            self.in_use += num_bytes
            fut.set_result(None)

    @contextlib.asynccontextmanager
    async def hold(self, num_bytes: int) -> AsyncIterator[None]:
        await self.acquire(num_bytes)
        try:
            yield
        finally:
            self.release(num_bytes)
