"""Whether the step loop has a worker, and what waits while it has none.

The engine's loop opens an Execute stream whenever the worker answers; the
worker counts as up exactly while one is open (`WorkerWatch.up`, told to
`on_change`). When a stream breaks the engine fails the requests the worker
held and calls `lost`; the others wait (`wait_ready`) until the worker is
back or `reconnect_s` (the scheduler's --worker-reconnect) has passed since
it was lost. Then they fail, and so does every new request until the
worker is back (`check_admission`): it would only wait to fail.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvstash import errors
from scheduler_svc.worker_link import WorkerLink

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outage:
    """The worker lost, since `since` (event-loop time), for `reason`.
    Requests that need nothing from it wait for it until `deadline`; then
    they fail (`give_up`), and new ones are refused until it is back."""

    since: float
    reason: str
    limit_s: float  # the scheduler's --worker-reconnect
    given_up: bool = False

    @property
    def deadline(self) -> float:
        return self.since + self.limit_s

    def give_up(self) -> errors.Unavailable:
        """What the requests that waited fail with."""
        self.given_up = True
        return errors.Unavailable(
            f"worker unavailable: not back within {self.limit_s:g} s (scheduler "
            f"--worker-reconnect) after it was lost ({self.reason})")

    def check_admission(self) -> None:
        """Unavailable once given up: a new request would only wait to fail."""
        if self.given_up:
            raise errors.Unavailable(f"worker unavailable: gone for over {self.limit_s:g} s "
                                     f"({self.reason}); retry later")



class WorkerWatch:
    def __init__(self, worker: WorkerLink, reconnect_s: float,
                 on_change: Callable[[bool], Awaitable[None]] | None = None) -> None:
        """`on_change(up)` is awaited each time the worker comes up or goes."""
        self._worker = worker
        self._reconnect_s = reconnect_s
        self._on_change = on_change
        self._up = asyncio.Event()
        self._outage: Outage | None = None  # from `lost` until it is back

    @property
    def up(self) -> bool:
        """An Execute stream to a live worker is open: requests can run."""
        return self._up.is_set()

    async def wait_up(self) -> None:
        await self._up.wait()

    def check_admission(self) -> None:
        """Unavailable while the worker is given up on."""
        if self._outage is not None:
            self._outage.check_admission()

    def lost(self, reason: str) -> None:
        """The stream broke for `reason`; the wait's bound counts from the
        first loss (a worker that comes back only to break again gets no
        new one)."""
        if self._outage is None:
            self._outage = Outage(asyncio.get_running_loop().time(), reason, self._reconnect_s)

    async def wait_ready(self, fail_waiting: Callable[[errors.Unavailable], None]) -> None:
        """Returns once the worker answers. From `reconnect_s` after it was
        lost until then, `fail_waiting` fails what waits for it, again every
        retry_s (a Decode or a taken-back hand-off may still come in)."""
        outage = self._outage
        if outage is None:
            await self._worker.wait_ready()
            return
        deadline = outage.deadline
        while not await self._worker.wait_ready(deadline):
            if not outage.given_up:
                log.error("worker not back within %g s; failing the requests waiting for it",
                          outage.limit_s)
            fail_waiting(outage.give_up())
            deadline = asyncio.get_running_loop().time() + self._worker.retry_s

    async def set_up(self, up: bool) -> None:
        """The stream opened (the outage, if any, is over) or broke."""
        if up == self._up.is_set():
            return
        if up:
            self._up.set()
            self._outage = None
            log.info("worker stream open; serving")
        else:
            self._up.clear()
        if self._on_change is not None:
            await self._on_change(up)
