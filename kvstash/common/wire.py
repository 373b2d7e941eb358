"""Proto <-> domain conversions shared by every service: sampling and KV layout,
and the ranges of the unsigned fields clients fill (`check_uint`).

Proto3 reads an unset scalar as 0, so `top_p` 0 means "unset" (1.0, off);
`max_tokens` and `temperature` track presence (unset: until the context
ends, and DEFAULT_TEMPERATURE). Those rules live here and nowhere else.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from kvstash.common.layout import Layout
from kvstash.common.sampling import DEFAULT_TEMPERATURE, Room, SamplingParams
from kvstash.errors import InvalidArgument
from kvstash.v1 import common_pb2


def sampling_from_proto(proto: common_pb2.SamplingParams, room: Room | None = None
                        ) -> SamplingParams:
    """Raises InvalidArgument naming a bad value. `room`: where a client's
    request must fit, which sets max_tokens by its rule (Room.max_tokens);
    None for a worker, which is sent every value (max_tokens unset is
    refused)."""
    requested = proto.max_tokens if proto.HasField("max_tokens") else None
    if room is not None:
        max_tokens = room.max_tokens(requested)
    elif requested is None:
        raise InvalidArgument("max_tokens must be set: a worker is sent every value")
    else:
        max_tokens = requested
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=proto.temperature if proto.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_p=proto.top_p or 1.0,
        top_k=proto.top_k,
        seed=proto.seed if proto.HasField("seed") else None,
        stop_token_ids=tuple(proto.stop_token_ids),
        ignore_eos=proto.ignore_eos,
    )


def check_uint(name: str, value: int, bits: int = 32) -> None:
    """InvalidArgument naming `name` unless `value` fits a proto uint of `bits`
    (protobuf's own ValueError names no field)."""
    if not 0 <= value < 1 << bits:
        raise InvalidArgument(f"{name} is {value}, must be in [0, 2**{bits})")


def check_uints(name: str, values: Sequence[int], bits: int = 32) -> None:
    """`check_uint` for each of `values`, naming the first bad one by index
    (`len`, not truth: a numpy array has none)."""
    if len(values) and (min(values) < 0 or max(values) >= 1 << bits):
        index = next(i for i, v in enumerate(values) if not 0 <= v < 1 << bits)
        check_uint(f"{name}[{index}]", values[index], bits)


@functools.lru_cache(maxsize=4096)
def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Built once per distinct setting, not once per sequence per step; callers
    copy it into their messages and never mutate it."""
    proto = common_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        proto.seed = params.seed
    return proto


def layout_to_proto(layout: Layout) -> common_pb2.KvLayout:
    return common_pb2.KvLayout(
        num_layers=layout.num_layers, block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
    )


def layout_from_proto(proto: common_pb2.KvLayout) -> Layout:
    """Raises InvalidArgument naming a bad field."""
    return Layout(proto.num_layers, proto.block_size, proto.num_kv_heads, proto.head_dim,
                  proto.dtype)
