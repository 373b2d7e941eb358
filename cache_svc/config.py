"""The cache service's one configuration object, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from cache_svc.disk import MIN_FILE_BYTES
from cache_svc.model import pages
from kvstash.cache_sdk.chunk_codec import MAX_CHUNK_BYTES
from kvstash.common.metrics import DEFAULT_METRICS_HOST, listen_host
from kvstash.common.units import GIB, MIB

# Chunks of max_inflight_bytes an admitted put holds (see cache_svc.put_stream).
PUT_SHARE_CHUNKS = 3
# What gRPC accepts on a stream before the server asks for a message (the
# HTTP/2 initial window; cache_svc.server.SERVER_OPTIONS). Smaller windows
# cost single-stream put throughput: 64 KiB ran ~30% slower than this on
# loopback, since a put then moves one message per window update.
STREAM_WINDOW_BYTES = 2 * MIB
MAX_STREAMS_PER_CONNECTION = 32  # further calls wait on the client's side
# Allocator slack: freed chunk copies the heap keeps until the sweeper trims it.
HEAP_SLACK_BYTES = 32 * MIB
# What a listed snapshot costs in either tier beyond its bytes: its entry,
# metadata, checksums and place in the listing (measured ~0.8 KiB; 60,000
# snapshots of 4 bytes took 4.8 KiB each with their pages).
ENTRY_BYTES = 2 * 1024


# What the cache process holds idle (measured: interpreter, grpc, protobuf,
# prometheus); a deployment's memory limit adds it to budget and overhead.
IDLE_PROCESS_BYTES = 45 * MIB
# The longest TTL the wire carries (SnapshotHeader.ttl_s is a uint32).
MAX_TTL_S = 2**32 - 1


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Budgets and limits of one cache server.

    Resident memory stays within `memory_budget_bytes` (committed snapshots,
    the preallocated buffers of puts in progress, and freed buffers pooled for
    reuse, which are unmapped as soon as a put needs their room) plus an
    overhead that no client behaviour raises (`overhead_bytes`):
      - the idle process: ~45 MiB (interpreter, grpc, protobuf, prometheus:
        IDLE_PROCESS_BYTES, measured);
      - chunk payload between the network and the snapshot buffers: 4 times
        `max_inflight_bytes`. An admitted put holds three chunks of it from
        admission to its end (cache_svc.put_stream says which), a get one per
        chunk it is sending; a chunk exists about twice on its way (gRPC's
        buffers, then Python's bytes), and a client sending chunks larger
        than its header declared is refused at the first;
      - STREAM_WINDOW_BYTES per open put stream, and at most
        `max_concurrent_rpcs` streams over all connections: what gRPC takes
        in before the server asks for payload, e.g. from a client that sends
        chunks without waiting for admission (see cache.proto). Nothing more
        of a put is read before it is admitted;
      - HEAP_SLACK_BYTES of freed heap, returned to the OS by the sweeper
        (pooled buffers go after `buffer_pool_idle_s`);
      - ENTRY_BYTES per listed snapshot, at most `max_snapshots` of them.
    The budgets charge a snapshot's bytes in whole pages (a mapping's, an
    arena extent's, a file's with its head and checksums: model.pages), so
    many small snapshots cannot hold more than their charge either.
    Measured with 32 puts of 64 MiB against a 256 MiB budget, their clients
    sending every chunk before admission: peak 90-120 MiB over idle + budget,
    of the 288 MiB this allows (tests/cache_svc/test_cache_memory.py).
    """

    memory_budget_bytes: int = 1 * GIB
    # Share of the memory budget unpinned snapshots (the prefix tier's
    # segments) may hold; beyond it an unpinned put moves older unpinned ones
    # out (to disk, or evicted). Unpinned puts never displace pinned ones.
    unpinned_share: float = 0.5
    disk_dir: Path | None = None  # None = no disk tier
    disk_budget_bytes: int = 0
    default_ttl_s: int = 3600  # for puts that send ttl_s = 0
    # Snapshots listed at most, both tiers (puts in progress included): each
    # costs ENTRY_BYTES of bookkeeping whatever its size. A put beyond it
    # evicts the least recently used unpinned snapshot, or is refused.
    max_snapshots: int = 32768
    sweep_interval_s: float = 5.0  # how often expired snapshots are looked for
    # Chunk payload bytes being received or sent at once, over all streams:
    # an admitted put holds PUT_SHARE_CHUNKS chunks, a get one chunk per send.
    max_inflight_bytes: int = 32 * MIB
    # Calls served at once over all connections; gRPC answers any further one
    # with RESOURCE_EXHAUSTED (a scheduler then recomputes instead).
    max_concurrent_rpcs: int = 128
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
    # Address /metrics listens on: loopback by default; 0.0.0.0 (or a pod IP)
    # to be scraped from elsewhere.
    metrics_host: str = DEFAULT_METRICS_HOST
    # Freed snapshot buffers kept, within the memory budget, for later puts of
    # the same size (saves them the kernel's page faults and zeroing); 0 = off.
    # They cap how much of the budget stays resident while nothing uses it.
    # Unused with an arena, which is resident whole.
    buffer_pool_bytes: int = 1 * GIB
    buffer_pool_idle_s: float = 60.0  # pooled buffers unused this long are unmapped
    # Keep the memory tier in a shared-memory arena file in this directory
    # (e.g. /dev/shm) that co-located workers map (cache_svc.arena); None =
    # private memory, reachable only through gRPC streams. The arena is
    # allocated whole at start: resident memory is then the budget, at once.
    arena_dir: Path | None = None
    # How long a co-located put may hold its extent before committing, and a
    # co-located get may hold a snapshot before it is done reading. Also how
    # long the extent of a put ended without its writer's answer (cut off by
    # it, cancelled, its client gone) stays quarantined (arena_calls).
    shared_lease_s: float = 60.0
    # How long a streamed put may wait for its client's next message (pacing
    # by bandwidth_limit included) before it is abandoned, DEADLINE_EXCEEDED.
    put_idle_s: float = 30.0
    # How long a streamed get may wait for its client to take the next
    # message before it is abandoned: a reader that stops reading holds a
    # share of the in-flight budget and keeps its snapshot from moving.
    get_idle_s: float = 30.0

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
        if self.disk_dir is not None and self.disk_budget_bytes < pages(MIN_FILE_BYTES):
            # A tier that holds no snapshot would also evict, at start, every
            # snapshot a previous run left in disk_dir.
            raise ValueError(
                f"disk_dir is {self.disk_dir} but disk_budget_bytes is "
                f"{self.disk_budget_bytes}, less than the smallest snapshot file "
                f"({pages(MIN_FILE_BYTES)} bytes): give the disk tier a budget "
                "(--disk-budget), or no disk_dir for none"
            )
        if not 0 < self.unpinned_share <= 1:
            raise ValueError(f"unpinned_share is {self.unpinned_share}, must be in (0, 1]")
        if self.disk_budget_bytes < 0:
            raise ValueError(f"disk_budget_bytes is {self.disk_budget_bytes}, must be >= 0")
        if self.max_snapshots < 1:
            raise ValueError(f"max_snapshots is {self.max_snapshots}, must be >= 1")
        if not 0 < self.default_ttl_s <= MAX_TTL_S:
            # Beyond it no header could carry the TTL: every put would commit,
            # then answer INTERNAL, as would each stat and get of it.
            raise ValueError(
                f"default_ttl_s is {self.default_ttl_s}, must be in [1, {MAX_TTL_S}]")
        # Durations: `not 0 < x < inf` refuses a NaN too (it fails every comparison).
        if not 0 < self.sweep_interval_s < math.inf:
            raise ValueError(
                f"sweep_interval_s is {self.sweep_interval_s}, must be > 0 and finite")
        if self.max_inflight_bytes < PUT_SHARE_CHUNKS * MAX_CHUNK_BYTES:
            raise ValueError(
                f"max_inflight_bytes is {self.max_inflight_bytes}, must be at least "
                f"{PUT_SHARE_CHUNKS * MAX_CHUNK_BYTES} (one put of {MAX_CHUNK_BYTES}-byte chunks)"
            )
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs is {self.max_concurrent_rpcs}, must be >= 1")
        if not 0 <= self.reserve_wait_s < math.inf:
            raise ValueError(f"reserve_wait_s is {self.reserve_wait_s}, must be >= 0 and finite")
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
        for name in ("buffer_pool_idle_s", "shared_lease_s", "put_idle_s", "get_idle_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} is {getattr(self, name)}, must be > 0 and finite")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port is {self.metrics_port}, must be in [0, 65535]")
        listen_host(self.metrics_host, "metrics_host")

    def unpinned_bytes(self) -> int:
        """The memory unpinned snapshots may hold (`unpinned_share`)."""
        return int(self.unpinned_share * self.memory_budget_bytes)

    def overhead_bytes(self, num_streams: int | None = None) -> int:
        """Resident memory beyond the idle process and the memory budget that
        `num_streams` open put streams (default: as many as may be open) may
        cost at most (see above)."""
        streams = self.max_concurrent_rpcs if num_streams is None else num_streams
        return (4 * self.max_inflight_bytes + streams * STREAM_WINDOW_BYTES + HEAP_SLACK_BYTES
                + self.max_snapshots * ENTRY_BYTES)
