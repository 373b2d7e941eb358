"""The cache service's one configuration object, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cache_svc.snapshot import MAX_CHUNK_BYTES

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Budgets and limits of one cache server.

    Resident memory is bounded by `memory_budget_bytes` (committed snapshots,
    the preallocated buffers of puts in progress, and freed buffers pooled for
    reuse, which are unmapped as soon as a put needs their room) plus a fixed
    overhead:
      - the idle process: ~45 MiB (interpreter, grpc, protobuf, prometheus);
      - chunks being copied: `max_inflight_bytes` times about 4 transient
        copies (gRPC slices, serialized bytes, parsed message, `.data`);
      - gRPC receive windows: up to 4 MiB (kvstash.rpc lookahead) per *admitted*
        put stream, at most the bytes it still has to send. Puts waiting for
        room send nothing: the server admits a put with initial metadata and
        CacheClient streams payload only after that.
    The test suite checks peak RSS <= idle + budget + 4 * max_inflight + 32 MiB
    with 32 concurrent streams (measured: 147-176 MiB against a 187 MiB limit).
    """

    memory_budget_bytes: int = 1 * GIB
    disk_dir: Path | None = None  # None = no disk tier
    disk_budget_bytes: int = 0
    default_ttl_s: int = 3600  # for puts that send ttl_s = 0
    sweep_interval_s: float = 5.0  # how often expired snapshots are looked for
    # Chunk payload bytes being received or sent at once, over all streams.
    # Each stream holds at most one chunk (<= 4 MiB) in flight.
    max_inflight_bytes: int = 32 * MIB
    # How long a put header may wait for spills and other puts to free room
    # before it is refused with RESOURCE_EXHAUSTED.
    reserve_wait_s: float = 10.0
    io_threads: int = 2  # disk reads, writes and scans run here, off the event loop
    # Caps the chunk payload rate of all puts and gets together (bytes per
    # second; 0 = unlimited), so KV traffic cannot starve other traffic.
    bandwidth_limit_bytes_per_s: int = 0
    # Test hook simulating a slow disk: caps write speed (0 = unthrottled).
    disk_write_bytes_per_s: float = 0.0
    metrics_port: int = 0  # Prometheus /metrics port; 0 = off
    # Freed snapshot buffers kept, within the memory budget, for later puts of
    # the same size (saves them the kernel's page faults and zeroing); 0 = off.
    # They cap how much of the budget stays resident while nothing uses it.
    buffer_pool_bytes: int = 1 * GIB
    buffer_pool_idle_s: float = 60.0  # pooled buffers unused this long are unmapped

    def __post_init__(self) -> None:
        if self.memory_budget_bytes < MAX_CHUNK_BYTES:
            raise ValueError(
                f"memory_budget_bytes is {self.memory_budget_bytes}, must be at least "
                f"{MAX_CHUNK_BYTES} (one chunk)"
            )
        if self.disk_dir is None and self.disk_budget_bytes != 0:
            raise ValueError(
                f"disk_budget_bytes is {self.disk_budget_bytes} but no disk_dir is set"
            )
        if self.disk_budget_bytes < 0:
            raise ValueError(f"disk_budget_bytes is {self.disk_budget_bytes}, must be >= 0")
        if self.default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s is {self.default_ttl_s}, must be > 0")
        if self.sweep_interval_s <= 0:
            raise ValueError(f"sweep_interval_s is {self.sweep_interval_s}, must be > 0")
        if self.max_inflight_bytes < MAX_CHUNK_BYTES:
            raise ValueError(
                f"max_inflight_bytes is {self.max_inflight_bytes}, must be at least "
                f"{MAX_CHUNK_BYTES} (one chunk)"
            )
        if self.reserve_wait_s < 0:
            raise ValueError(f"reserve_wait_s is {self.reserve_wait_s}, must be >= 0")
        if self.io_threads < 1:
            raise ValueError(f"io_threads is {self.io_threads}, must be >= 1")
        if self.bandwidth_limit_bytes_per_s < 0:
            raise ValueError(
                f"bandwidth_limit_bytes_per_s is {self.bandwidth_limit_bytes_per_s}, "
                "must be >= 0 (0 = unlimited)"
            )
        if self.disk_write_bytes_per_s < 0:
            raise ValueError(
                f"disk_write_bytes_per_s is {self.disk_write_bytes_per_s}, must be >= 0"
            )
        if self.buffer_pool_bytes < 0:
            raise ValueError(f"buffer_pool_bytes is {self.buffer_pool_bytes}, must be >= 0")
        if self.buffer_pool_idle_s <= 0:
            raise ValueError(f"buffer_pool_idle_s is {self.buffer_pool_idle_s}, must be > 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port is {self.metrics_port}, must be in [0, 65535]")
