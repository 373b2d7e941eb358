"""The KV block layout: one type for every service, without torch or protos.

A worker's cache tensor is [num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]; one block of it is `bytes_per_block` bytes, which
sizes snapshots in the scheduler (offload decisions) and in the cache service
(put validation). The worker reports its layout as this type, the scheduler
sizes its pool and checks decode peers with it, the cache client puts with
it, the cache stores it. Its wire form is common.proto `KvLayout`, converted
in `kvstash.common.wire` only (`layout_to_proto`, `layout_from_proto`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstash.errors import InvalidArgument, preview

ITEMSIZE_FOR_DTYPE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True, slots=True)
class Layout:
    """Shape of one KV block; InvalidArgument names a bad field."""

    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: str  # one of ITEMSIZE_FOR_DTYPE

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"layout {name} is {getattr(self, name)}, must be > 0")
        if self.dtype not in ITEMSIZE_FOR_DTYPE:
            raise InvalidArgument(
                f"layout dtype {preview(self.dtype)} unknown; expected one of "
                f"{sorted(ITEMSIZE_FOR_DTYPE)}"
            )

    @property
    def bytes_per_block(self) -> int:
        itemsize = ITEMSIZE_FOR_DTYPE[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def __str__(self) -> str:
        return (f"{self.num_layers} layers, block_size {self.block_size}, "
                f"{self.num_kv_heads} kv heads, head_dim {self.head_dim}, {self.dtype}")
