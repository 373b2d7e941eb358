"""The scheduler's link to the cache: which leading segments of a prompt the
cache holds (`stored_run`), against a fake client that answers as the cache
does, or as a newer one might."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstash import errors
from kvstash.common.ids import MAX_FIND_IDS
from kvstash.v1 import cache_pb2
from scheduler_svc.cache_link import CacheLink

MEMORY, DISK, NONE = cache_pb2.TIER_MEMORY, cache_pb2.TIER_DISK, cache_pb2.TIER_UNSPECIFIED


class FakeClient:
    """Holds `tiers[i]` for the i-th id of any lookup (NONE past them), and
    refuses more than MAX_FIND_IDS ids, as the cache does; `up`: whether it
    answers at all."""

    address = "fake"

    def __init__(self, tiers: Sequence[int] = ()) -> None:
        self.tiers = list(tiers)
        self.up = True
        self.num_asked: list[int] = []

    async def find(self, snapshot_ids: list[str], timeout_s: float | None = None) -> list[int]:
        self.num_asked.append(len(snapshot_ids))
        if not self.up:
            raise errors.Unavailable("the cache is down")
        if len(snapshot_ids) > MAX_FIND_IDS:
            raise errors.InvalidArgument(f"find takes 1-{MAX_FIND_IDS} snapshot ids")
        return (self.tiers + [NONE] * len(snapshot_ids))[:len(snapshot_ids)]

    async def stats(self, timeout_s: float | None = None) -> None:
        if not self.up:
            raise errors.Unavailable("the cache is down")


def ids(n: int) -> list[str]:
    return [f"pfx-{i:032x}" for i in range(n)]


def stored_run(client: FakeClient, segment_ids: list[str]) -> list[str] | None:
    return asyncio.run(CacheLink(client).stored_run(segment_ids))  # type: ignore[arg-type]


def test_the_run_ends_at_the_first_segment_not_stored() -> None:
    assert stored_run(FakeClient([MEMORY, DISK, NONE, MEMORY]), ids(4)) == ["memory", "disk"]


def test_a_tier_this_build_does_not_know_ends_the_run() -> None:
    """A newer cache may answer a tier added since: what it holds there is
    prefilled, as if not stored, and admission goes on."""
    assert stored_run(FakeClient([MEMORY, 7, MEMORY]), ids(3)) == ["memory"]


def test_a_prompt_of_more_segments_than_one_lookup_takes_asks_for_its_first() -> None:
    client = FakeClient([MEMORY])
    assert stored_run(client, ids(MAX_FIND_IDS + 1)) == ["memory"]
    assert client.num_asked == [MAX_FIND_IDS]


async def test_nothing_is_asked_while_the_latest_probe_went_unanswered() -> None:
    """Every admission would wait for the lookup's timeout: it counts as
    unanswered at once, until a probe answers again."""
    client = FakeClient([MEMORY])
    link = CacheLink(client, probe_s=0.01)  # type: ignore[arg-type]
    changes: list[bool] = []
    watching = asyncio.create_task(link.watch(changes.append))

    async def seen(up: bool) -> None:
        async with asyncio.timeout(10):
            while changes[-1:] != [up]:
                await asyncio.sleep(0.005)

    try:
        client.up = False
        await seen(False)
        assert await link.stored_run(ids(1)) is None and client.num_asked == []
        client.up = True
        await seen(True)
        assert await link.stored_run(ids(1)) == ["memory"]
    finally:
        watching.cancel()
