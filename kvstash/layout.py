"""The KV block layout every service agrees on (common.proto `KvLayout`), without torch.

A worker's cache tensor is [num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]; one block of it is `bytes_per_block` bytes, which
sizes snapshots in the scheduler (offload decisions) and in the cache service
(put validation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvstash.errors import InvalidArgument, preview

ITEMSIZE_FOR_DTYPE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


class LayoutFields(Protocol):
    """Anything shaped like a `KvLayout` message, read-only: a message, a
    `Layout`, a worker's frozen layout spec."""

    @property
    def num_layers(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...


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

    @classmethod
    def of(cls, fields: LayoutFields) -> Layout:
        """From a `KvLayout` message (or anything with its fields)."""
        return cls(fields.num_layers, fields.block_size, fields.num_kv_heads, fields.head_dim,
                   fields.dtype)

    @property
    def bytes_per_block(self) -> int:
        itemsize = ITEMSIZE_FOR_DTYPE[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize
