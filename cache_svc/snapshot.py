"""Domain types for one snapshot: its layout, its metadata, and the chunking.

A snapshot of n blocks is the worker's cache tensor
[num_layers, 2, n, block_size, num_kv_heads, head_dim] in row-major order,
sent as chunks of `chunk_bytes` (only the last may be shorter):

    0            chunk_bytes     2*chunk_bytes          total_bytes
    |-- chunk 0 --|-- chunk 1 ----|-- ... --|- last -|

Everything a client sends is validated here, before it reaches a tier; ids in
particular are checked against a strict alphabet (`kvstash.common.ids`) because the
disk tier names files after them. The chunk size limits and the checksum are
the wire's (`kvstash.cache_sdk.chunk_codec`), shared with CacheClient.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstash.cache_sdk.chunk_codec import CHECKSUM_XXH3_64, check_chunk_bytes
from kvstash.common.ids import check_snapshot_id
from kvstash.common.layout import Layout
from kvstash.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class SnapshotMeta:
    """What the put header declares; immutable once accepted."""

    snapshot_id: str
    layout: Layout
    num_blocks: int
    num_tokens: int  # tokens whose KV the blocks hold
    total_bytes: int  # == num_blocks * layout.bytes_per_block
    chunk_bytes: int  # size of every chunk but the last
    pinned: bool  # spilled under pressure, never evicted
    ttl_s: int  # seconds after the last access until expiry; already defaulted
    checksum_algorithm: str = CHECKSUM_XXH3_64

    def __post_init__(self) -> None:
        check_snapshot_id(self.snapshot_id)
        if self.num_blocks <= 0:
            raise InvalidArgument(f"num_blocks is {self.num_blocks}, must be > 0")
        if self.num_tokens < 0 or self.num_tokens > self.num_blocks * self.layout.block_size:
            raise InvalidArgument(
                f"num_tokens {self.num_tokens} does not fit {self.num_blocks} blocks of "
                f"{self.layout.block_size} tokens"
            )
        expected = self.num_blocks * self.layout.bytes_per_block
        if self.total_bytes != expected:
            raise InvalidArgument(
                f"total_bytes is {self.total_bytes}, but {self.num_blocks} blocks of "
                f"{self.layout.bytes_per_block} bytes make {expected}"
            )
        check_chunk_bytes(self.chunk_bytes)
        if self.checksum_algorithm != CHECKSUM_XXH3_64:
            raise InvalidArgument(
                f"checksum algorithm {self.checksum_algorithm!r} unsupported; "
                f"use {CHECKSUM_XXH3_64}"
            )
        if self.ttl_s <= 0:
            raise InvalidArgument(f"ttl_s is {self.ttl_s}, must be > 0 once defaulted")

    @property
    def num_chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_bytes)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Byte offsets [start, end) of chunk `index`."""
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    def chunk_size(self, index: int) -> int:
        """Payload bytes of chunk `index`; 0 past the last chunk."""
        start, end = self.chunk_range(index)
        return max(0, end - start)
