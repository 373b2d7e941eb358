"""Store-side records: where a snapshot's bytes live, and the results the
store hands to its callers."""

from __future__ import annotations

import enum
import mmap
from dataclasses import dataclass
from pathlib import Path

from cache_svc.snapshot import SnapshotMeta

# A snapshot's bytes in memory: a private mapping, or an extent of the arena.
Buffer = mmap.mmap | memoryview


class Residence(enum.Enum):
    MEMORY = "memory"  # only in memory
    SPILLING = "spilling"  # in memory, being copied to disk; still served from memory
    DISK = "disk"  # on disk (a memory copy may linger while a reader holds it)


class TierName(enum.Enum):
    MEMORY = "memory"
    DISK = "disk"


@dataclass(slots=True, eq=False)
class Entry:
    """One committed snapshot. Invariant kept by the store: memory is charged
    for the entry while `buffer` is set, disk while it is listed with `path` set."""

    meta: SnapshotMeta
    residence: Residence
    last_access: float  # store clock seconds; TTL counts from here
    # Per-chunk checksums verified at put time and kept in the disk file, so
    # gets send them instead of hashing what they read: damage at rest is
    # then caught by the client.
    checksums: tuple[int, ...]
    buffer: Buffer | None = None  # the bytes, while in memory
    path: Path | None = None  # the file, once on disk
    num_readers: int = 0  # gets in progress; a busy entry is never spilled or evicted

    @property
    def size(self) -> int:
        return self.meta.total_bytes

    @property
    def tier(self) -> TierName:
        return TierName.DISK if self.residence is Residence.DISK else TierName.MEMORY


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    meta: SnapshotMeta
    tier: TierName


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Mirrors kvstash.v1.CacheStats; see cache.proto for each field."""

    memory_bytes: int
    memory_budget_bytes: int
    memory_snapshots: int
    disk_bytes: int
    disk_budget_bytes: int
    disk_snapshots: int
    pinned_bytes: int
    reserved_bytes: int
    num_puts: int
    num_gets: int
    num_refused: int
    num_failed_puts: int
    num_evictions: int
    num_spills: int
    num_expired: int
    bytes_in: int
    bytes_out: int
    free_bytes: int
    num_consumed: int
    num_shared_puts: int
    num_shared_gets: int


@dataclass(slots=True)
class Counters:
    """The store's event counts (evictions and spills are counted by `Tiers`)."""

    num_puts: int = 0
    num_gets: int = 0
    num_refused: int = 0
    num_failed_puts: int = 0
    num_expired: int = 0
    num_consumed: int = 0  # snapshots deleted by the get that consumed them
    num_shared_puts: int = 0  # puts and gets through the arena
    num_shared_gets: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
