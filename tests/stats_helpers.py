"""Checking a stats proto message against the stats declared for it (kvstash.common.stats)."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from kvstash.common.stats import Kind, Stat

_T = FieldDescriptor
# The proto types a declared stat may travel as: no figure is negative, and a
# counter keeps growing for as long as the service runs.
_PROTO_TYPES = {
    (bool, Kind.GAUGE): {"bool"},
    (float, Kind.GAUGE): {"double"},
    (int, Kind.GAUGE): {"uint32", "uint64"},
    (int, Kind.COUNTER): {"uint64"},
}
_TYPE_NAMES = {_T.TYPE_BOOL: "bool", _T.TYPE_DOUBLE: "double", _T.TYPE_UINT32: "uint32",
               _T.TYPE_UINT64: "uint64"}


def proto_mismatches(stats: Sequence[Stat], message: Descriptor) -> list[str]:
    """What keeps `message`'s fields from matching `stats` one to one, by name
    and type (empty when they do)."""
    declared = {s.name: s for s in stats}
    fields = {f.name: f for f in message.fields}
    problems = [f"{name}: declared, not in {message.name}"
                for name in sorted(declared.keys() - fields.keys())]
    problems += [f"{name}: in {message.name}, not declared"
                 for name in sorted(fields.keys() - declared.keys())]
    for name in sorted(declared.keys() & fields.keys()):
        stat, proto = declared[name], fields[name]
        allowed = _PROTO_TYPES.get((stat.type, stat.kind), set())
        proto_type = ("repeated " if proto.is_repeated else "") + _TYPE_NAMES.get(
            proto.type, f"type {proto.type}")
        if proto_type not in allowed:
            problems.append(f"{name}: a {stat.type.__name__} {stat.kind.value} travels as "
                            f"{' or '.join(sorted(allowed))}, not {proto_type}")
    return problems


def count_distinct(counters: Any) -> None:
    """Sets every field of dataclass `counters` to a value no other field gets,
    so a figure copied or exported in another's place shows."""
    for f in dataclasses.fields(counters):
        setattr(counters, f.name, zlib.crc32(f.name.encode()) % 100_000 + 1)
