"""Victim choice: how to free memory for a new put (policy; the store acts).

Walking memory snapshots from least to most recently used, each is either
  - spilled to disk, if the disk has room, after evicting least recently used
    unpinned disk snapshots where that makes enough room; or
  - evicted, if it is unpinned and the disk cannot take it; or
  - skipped (pinned and no disk room: pinned snapshots are never dropped).
Busy snapshots (being read or already spilling) are never chosen. A plan is
returned only when it frees enough (`enough`: in bytes, or, in an arena,
in one contiguous range); otherwise nothing is touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cache_svc.model import Entry, Residence


@dataclass(slots=True)
class Plan:
    spill: list[Entry] = field(default_factory=list)  # memory -> disk
    evict_memory: list[Entry] = field(default_factory=list)  # dropped from memory
    evict_disk: list[Entry] = field(default_factory=list)  # dropped from disk first


def plan_room(lru_entries: Iterable[Entry], disk_free: int,
              enough: Callable[[list[Entry]], bool]) -> Plan | None:
    """`lru_entries`: every listed entry, least recently used first.
    `enough(victims)`: whether moving those memory entries out (on top of
    the spills in progress) makes the room the put needs. Victims are taken
    in LRU order until it is; None if they never make it."""
    entries = list(lru_entries)
    disk_victims = [
        e for e in entries
        if e.residence is Residence.DISK and not e.meta.pinned and e.num_readers == 0
    ]
    disk_evictable = sum(e.size for e in disk_victims)
    plan = Plan()
    victims: list[Entry] = []
    for entry in entries:
        if enough(victims):
            break
        if entry.residence is not Residence.MEMORY or entry.num_readers:
            continue
        if disk_free + disk_evictable >= entry.size:
            while disk_free < entry.size:
                victim = disk_victims.pop(0)
                plan.evict_disk.append(victim)
                disk_free += victim.size
                disk_evictable -= victim.size
            disk_free -= entry.size
            plan.spill.append(entry)
        elif not entry.meta.pinned:
            plan.evict_memory.append(entry)
        else:
            continue
        victims.append(entry)
    return plan if enough(victims) else None
