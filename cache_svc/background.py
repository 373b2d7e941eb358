"""The tiers' background work: blocking I/O on a thread pool (`run_io`),
tasks that `close` waits for (`spawn`), and the event that wakes puts
waiting for room (`notify`, `changed`).

Bookkeeping stays on the event loop; only the blocking calls (disk reads and
writes, unlinks, unmaps, populating a mapping) go to the threads. Unlinks
have a thread of their own (`run_unlink`): behind a spill of gigabytes on the
pool, a deleted snapshot's file would outlive its delete by seconds, and come
back with a crash meanwhile. An unlink is done once its directory is fsynced
(a power loss brings it back before that), one fsync for the unlinks before
it. Every spawned task's end is a change: a put waiting for room looks again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class Background:
    def __init__(self, io_threads: int) -> None:
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="cache-io")
        self._unlinks = ThreadPoolExecutor(1, thread_name_prefix="cache-unlink")
        self._sync: asyncio.Future[Any] | None = None  # the last directory fsync asked for
        self._tasks: set[asyncio.Task[Any]] = set()
        # Set, and replaced, by `notify`: a waiter takes the current one and
        # wakes at the next change.
        self.changed = asyncio.Event()

    @property
    def busy(self) -> bool:
        """Whether a spawned task (a spill, an unlink, an unmap) is running."""
        return bool(self._tasks)

    def notify(self) -> None:
        """Wakes puts waiting for room: something may have freed some."""
        self.changed.set()
        self.changed = asyncio.Event()

    def spawn(self, coro: Any) -> asyncio.Future[Any]:
        """Runs `coro` as a task that `close` waits for (and that counts as a
        change in progress while it runs: `busy`)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        # A put waiting for room because this was running must look again:
        # it may now be refused at once instead of at its deadline.
        self._tasks.discard(task)
        self.notify()

    async def run_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def run_unlink(self, unlink: Callable[[], Any], sync: Callable[[], Any]) -> None:
        """`unlink()` on the unlink thread, queued behind no disk read or
        write, then `sync()` there (the directory's fsync)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._unlinks, unlink)
        # The thread runs one call at a time, in order: a sync not done yet
        # starts (or started) after this unlink, so it covers it too.
        if self._sync is None or self._sync.done():
            self._sync = loop.run_in_executor(self._unlinks, sync)
        await asyncio.shield(self._sync)

    async def close(self) -> None:
        """Lets every spawned task finish (including those spawned meanwhile),
        then stops the I/O threads."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._io.shutdown(wait=True)
        self._unlinks.shutdown(wait=True)
