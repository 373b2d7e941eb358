"""The scheduler's link to the cache service: is it there, snapshot deletes,
and which prompt segments its prefix tier holds.

The scheduler keeps no account of the cache's bytes: the cache's own
admission (RESOURCE_EXHAUSTED on a put) is the one capacity answer. What the
scheduler needs is whether the cache answers at all, so that AUTO preemption
recomputes at once while it is down instead of trying every offload.
Snapshots are moved and consumed by the worker; the scheduler only deletes
the ones nobody will restore (aborted requests, failed copies).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common.ids import MAX_FIND_IDS
from kvstash.v1 import cache_pb2

log = logging.getLogger(__name__)

_TIER_NAMES: dict[int, str] = {cache_pb2.TIER_MEMORY: "memory", cache_pb2.TIER_DISK: "disk"}


class CacheLink:
    def __init__(self, client: CacheClient, probe_s: float = 0.5, timeout_s: float = 10.0,
                 find_timeout_s: float = 0.5) -> None:
        """Probes every `probe_s`; a call that takes over `timeout_s` counts as
        failed. A prefix lookup waits `find_timeout_s` at most: it delays a
        request's admission, and without an answer the request just prefills."""
        self._client = client
        self._probe_s = probe_s
        self._timeout_s = timeout_s
        self._find_timeout_s = find_timeout_s
        # The latest probe's answer (None: none yet).
        self._available: bool | None = None

    async def stored_run(self, segment_ids: list[str]) -> list[str] | None:
        """Where the cache holds `segment_ids` (a prompt's, in order) from the
        first on, up to the first it does not ("memory" or "disk" each); None
        when it does not answer in time, or its latest probe went unanswered
        (then nothing is asked: every admission would wait for the lookup)."""
        if self._available is False:
            return None
        # Only the leading run counts: a longer prompt's first MAX_FIND_IDS
        # segments are asked, as the cache refuses more in one call.
        try:
            tiers = await self._client.find(segment_ids[:MAX_FIND_IDS],
                                            timeout_s=self._find_timeout_s)
        except errors.KvstashError as exc:
            log.debug("prefix lookup failed (%s); prefilling", exc)
            return None
        run = []
        for tier in tiers:
            # Not stored, or a tier this build does not know (a newer cache's):
            # the run ends there, and the rest is prefilled.
            if (name := _TIER_NAMES.get(tier)) is None:
                break
            run.append(name)
        return run

    async def watch(self, on_change: Callable[[bool], None]) -> None:
        """Probes the cache every `probe_s` and calls `on_change(available)`
        on every change (first with the first answer). Logs changes, not
        probes. Runs until cancelled."""
        address = self._client.address
        while True:
            try:
                await self._client.stats(timeout_s=self._timeout_s)
                now = True
            except errors.KvstashError as exc:
                now = False
                if self._available is not False:
                    log.warning("cache service %s unreachable (%s); preemptions recompute "
                                "until it is back", address, exc)
            if now != self._available:
                if now:
                    log.info("cache service %s available", address)
                self._available = now
                on_change(now)
            await asyncio.sleep(self._probe_s)

    async def delete(self, snapshot_ids: list[str]) -> None:
        """Best effort: a snapshot gone already is fine, and one the cache could
        not be reached for expires by its TTL."""
        for snapshot_id in snapshot_ids:
            with contextlib.suppress(errors.KvstashError):
                await self._client.delete(snapshot_id, timeout_s=self._timeout_s)
