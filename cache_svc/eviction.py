"""Victim choice: how to free memory for a new put (policy; the store acts).

Walking memory snapshots from least to most recently used, each is either
  - spilled to disk, if the disk has room, after evicting least recently used
    unpinned disk snapshots where that makes enough room (neither while
    spills rest after one failed); or
  - evicted, if it is unpinned and the disk cannot take it, or only by
    evicting a snapshot used more recently (unpinned ones go LRU); or
  - skipped (pinned and no disk room: pinned snapshots are never dropped).
Busy snapshots (being read or already spilling) are never chosen, nor, for an
unpinned put (a prefix-tier segment), pinned ones: those take precedence, and
an unpinned put over its share of the budget must also move as many bytes of
unpinned snapshots out (`CappedRoom`). A plan is
returned only when it frees enough (`Room`: in bytes, `BytesRoom`, or, in an
arena, in one contiguous range, `ArenaRoom`); otherwise nothing is touched.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from cache_svc.arena import FreeRuns
from cache_svc.model import Entry, Residence


@dataclass(slots=True)
class Plan:
    spill: list[Entry] = field(default_factory=list)  # memory -> disk
    evict_memory: list[Entry] = field(default_factory=list)  # dropped from memory
    evict_disk: list[Entry] = field(default_factory=list)  # dropped from disk first


class Room(Protocol):
    """The room a put needs, counting the memory entries moved out so far
    (on top of the spills in progress)."""

    def enough(self) -> bool: ...

    def add(self, victim: Entry) -> None: ...


@dataclass(slots=True)
class BytesRoom:
    """Room in bytes: private mappings can go anywhere."""

    free: int
    size: int

    def enough(self) -> bool:
        return self.free >= self.size

    def add(self, victim: Entry) -> None:
        self.free += victim.memory_bytes


@dataclass(slots=True)
class ArenaRoom:
    """Room in an arena: one free range long enough."""

    runs: FreeRuns
    size: int

    def enough(self) -> bool:
        return self.runs.longest >= self.size

    def add(self, victim: Entry) -> None:
        assert isinstance(victim.buffer, memoryview)  # in an arena, every buffer is
        self.runs.free(victim.buffer)


@dataclass(slots=True)
class CappedRoom:
    """`room`, and `excess` bytes of unpinned snapshots out of memory."""

    room: Room
    excess: int

    def enough(self) -> bool:
        return self.excess <= 0 and self.room.enough()

    def add(self, victim: Entry) -> None:
        self.excess -= victim.memory_bytes
        self.room.add(victim)


def plan_room(lru_entries: Iterable[Entry], disk_free: int, room: Room,
              unpinned_only: bool = False, spill: bool = True) -> Plan | None:
    """`lru_entries`: every listed entry, least recently used first. Victims
    (unpinned ones only, with `unpinned_only`) are added to `room` in LRU
    order until it has enough; None if they never make it. Without `spill`,
    nothing is spilled (nor evicted from disk to make room for a spill)."""
    entries = list(lru_entries)
    # Unpinned disk snapshots nobody reads, and their places in the LRU order.
    disk_victims = [
        (place, e) for place, e in enumerate(entries)
        if e.residence is Residence.DISK and not e.meta.pinned and e.num_readers == 0
    ]
    plan = Plan()
    for place, entry in enumerate(entries):
        if room.enough():
            break
        if (entry.residence is not Residence.MEMORY or entry.num_readers
                or (unpinned_only and entry.meta.pinned)):
            continue
        num = _num_to_evict(disk_victims, disk_free, entry.disk_bytes) if spill else None
        if num and not entry.meta.pinned and disk_victims[num - 1][0] > place:
            num = None  # it goes itself, not a snapshot used more recently
        if num is not None:
            evicted, disk_victims = disk_victims[:num], disk_victims[num:]
            plan.evict_disk += [victim for _, victim in evicted]
            disk_free += sum(victim.disk_bytes for _, victim in evicted) - entry.disk_bytes
            plan.spill.append(entry)
        elif not entry.meta.pinned:
            plan.evict_memory.append(entry)
        else:
            continue
        room.add(entry)
    return plan if room.enough() else None


def _num_to_evict(disk_victims: list[tuple[int, Entry]], disk_free: int,
                  size: int) -> int | None:
    """How many of `disk_victims`, first ones first, must go for `size` bytes
    to fit on the disk; None if not even all of them make room."""
    num = 0
    while disk_free < size:
        if num == len(disk_victims):
            return None
        disk_free += disk_victims[num][1].disk_bytes
        num += 1
    return num


def over_limits(lru_entries: Iterable[Entry], disk_used: int, disk_budget: int,
                max_snapshots: int) -> tuple[list[Entry], int, int]:
    """After a restart with a smaller disk budget or max_snapshots than
    before: the least recently used unpinned snapshots that bring the disk
    tier and the listing back within both (as many as there are), and by how
    many bytes and snapshots the pinned ones alone still exceed them."""
    entries = list(lru_entries)
    over, extra = disk_used - disk_budget, len(entries) - max_snapshots
    victims = []
    for entry in (e for e in entries if not e.meta.pinned):
        if over <= 0 and extra <= 0:
            break
        victims.append(entry)
        over, extra = over - entry.disk_bytes, extra - 1
    return victims, max(0, over), max(0, extra)


def slot_victims(lru_entries: Iterable[Entry], num: int) -> list[Entry] | None:
    """The `num` least recently used unpinned snapshots nobody reads or
    spills, making room in the listing (max_snapshots); None if fewer can go."""
    victims = [e for e in lru_entries if not e.meta.pinned and not e.num_readers
               and e.residence is not Residence.SPILLING][:num]
    return victims if len(victims) == num else None
