"""Cache protos <-> the cache's domain types (the only place they meet)."""

from __future__ import annotations

from cache_svc.model import CacheStats, SnapshotInfo, TierName
from cache_svc.snapshot import SnapshotMeta
from kvstash import errors
from kvstash.cache_sdk.chunk_codec import CHECKSUM_XXH3_64
from kvstash.common.stats import values
from kvstash.common.wire import layout_from_proto, layout_to_proto
from kvstash.v1 import cache_pb2

_ALGORITHM_NAMES = {cache_pb2.CHECKSUM_ALGORITHM_XXH3_64: CHECKSUM_XXH3_64}
_ALGORITHM_CODES = {name: code for code, name in _ALGORITHM_NAMES.items()}
_TIER_CODES = {TierName.MEMORY: cache_pb2.TIER_MEMORY, TierName.DISK: cache_pb2.TIER_DISK}


def meta_from_proto(header: cache_pb2.SnapshotHeader, default_ttl_s: int) -> SnapshotMeta:
    if header.checksum_algorithm not in _ALGORITHM_NAMES:
        raise errors.InvalidArgument(
            f"checksum algorithm {header.checksum_algorithm} unsupported; "
            f"use CHECKSUM_ALGORITHM_XXH3_64 ({cache_pb2.CHECKSUM_ALGORITHM_XXH3_64})"
        )
    return SnapshotMeta(
        snapshot_id=header.snapshot_id,
        layout=layout_from_proto(header.layout),
        num_blocks=header.num_blocks,
        num_tokens=header.num_tokens,
        total_bytes=header.total_bytes,
        chunk_bytes=header.chunk_bytes,
        pinned=header.pinned,
        ttl_s=header.ttl_s or default_ttl_s,
        checksum_algorithm=_ALGORITHM_NAMES[header.checksum_algorithm],
    )


def meta_to_proto(meta: SnapshotMeta) -> cache_pb2.SnapshotHeader:
    return cache_pb2.SnapshotHeader(
        snapshot_id=meta.snapshot_id,
        layout=layout_to_proto(meta.layout),
        num_blocks=meta.num_blocks,
        num_tokens=meta.num_tokens,
        total_bytes=meta.total_bytes,
        chunk_bytes=meta.chunk_bytes,
        checksum_algorithm=_ALGORITHM_CODES[meta.checksum_algorithm],
        pinned=meta.pinned,
        ttl_s=meta.ttl_s,
    )


def info_to_proto(info: SnapshotInfo) -> cache_pb2.SnapshotInfo:
    return cache_pb2.SnapshotInfo(
        header=meta_to_proto(info.meta), tier=_TIER_CODES[info.tier],
        num_chunks=info.meta.num_chunks,
    )


def found_to_proto(tiers: list[TierName | None]) -> cache_pb2.FindSnapshotsResponse:
    return cache_pb2.FindSnapshotsResponse(
        tiers=[cache_pb2.TIER_UNSPECIFIED if t is None else _TIER_CODES[t] for t in tiers])


def stats_to_proto(stats: CacheStats) -> cache_pb2.CacheStats:
    """Every declared stat (kvstash.common.stats) into the proto field of its name; a
    test keeps the two one to one, in names and types."""
    return cache_pb2.CacheStats(**values(stats))
