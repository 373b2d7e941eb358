"""Store-side records: where a snapshot's bytes live, and the results the
store hands to its callers."""

from __future__ import annotations

import asyncio
import enum
import mmap
from dataclasses import dataclass
from pathlib import Path

from cache_svc.disk import file_bytes
from cache_svc.snapshot import SnapshotMeta
from kvstash.common.stats import counter, gauge

# A snapshot's bytes in memory: a private mapping, or an extent of the arena.
Buffer = mmap.mmap | memoryview
PAGE_BYTES = mmap.PAGESIZE


def pages(num_bytes: int) -> int:
    """`num_bytes` in whole pages: what a mapping, an arena extent or a file
    of them takes, and so what the budgets charge (a snapshot of 4 bytes
    costs a page)."""
    return -(-num_bytes // PAGE_BYTES) * PAGE_BYTES


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
    # Dropped while SPILLING: done once the file being written is gone again.
    unlinked: asyncio.Future[None] | None = None

    @property
    def memory_bytes(self) -> int:
        """What its buffer is charged against the memory budget."""
        return pages(self.meta.total_bytes)

    @property
    def disk_bytes(self) -> int:
        """What its file is charged against the disk budget."""
        return pages(file_bytes(self.meta))

    @property
    def tier(self) -> TierName:
        return TierName.DISK if self.residence is Residence.DISK else TierName.MEMORY


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    meta: SnapshotMeta
    tier: TierName


@dataclass(slots=True)
class Counters:
    """The store's event counts, incremented in place. Each field is declared
    once, here, with its metric (kvstash.common.stats); CacheStats carries them all."""

    num_puts: int = counter("puts", "Completed puts")
    num_gets: int = counter("gets", "Gets started")
    num_refused: int = counter("refused_puts", "Puts refused for capacity")
    num_failed_puts: int = counter("failed_puts",
                                   "Puts aborted: bad chunk, checksum, cancellation")
    num_expired: int = counter("expired", "Snapshots deleted after their TTL")
    num_consumed: int = counter("consumed", "Snapshots deleted by the get that consumed them")
    num_shared_puts: int = counter("shared_puts",
                                   "Of the puts, those through the shared-memory arena")
    num_shared_gets: int = counter("shared_gets",
                                   "Of the gets, those through the shared-memory arena")
    bytes_in: int = counter("bytes_in", "Chunk payload bytes received")
    bytes_out: int = counter("bytes_out", "Chunk payload bytes sent")


@dataclass(slots=True, kw_only=True)
class CacheStats(Counters):
    """A snapshot: every counter as it stood, plus the figures read from the
    tiers at the time. The service reports it over GetStats (kvstash.v1.CacheStats,
    field by field) and exports it as metrics; each field is declared once,
    here or in Counters (kvstash.common.stats)."""

    # Counted by Tiers, which evicts and spills.
    num_evictions: int = counter("evictions", "Unpinned snapshots evicted under pressure")
    num_spills: int = counter("spills", "Snapshots spilled from memory to disk")
    memory_bytes: int = gauge("Bytes held by the memory tier")
    memory_budget_bytes: int = gauge("Memory tier budget in bytes")
    memory_snapshots: int = gauge("Snapshots in the memory tier")
    disk_bytes: int = gauge("Bytes held by the disk tier")
    disk_budget_bytes: int = gauge("Disk tier budget in bytes")
    disk_snapshots: int = gauge("Snapshots in the disk tier")
    pinned_bytes: int = gauge("Bytes of pinned snapshots, both tiers")
    reserved_bytes: int = gauge("Bytes reserved by puts in progress")
    free_bytes: int = gauge("Bytes a new put can still reserve, both tiers")
