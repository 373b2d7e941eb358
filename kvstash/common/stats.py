"""Each figure a service reports is declared once, as a field of its stats
dataclass made with `counter()` or `gauge()`:

    @dataclass(slots=True)
    class Counters:                      # what the service increments
        num_puts: int = counter("puts", "Completed puts")

    @dataclass(slots=True, kw_only=True)
    class CacheStats(Counters):          # every counter as it stood, plus the gauges
        memory_bytes: int = gauge("Bytes held by the memory tier")

Everything else reads the declarations (`declared`): the service's `stats()`
copies the counters with `values`, the edge converts to the proto field by
field, the Prometheus collector exports each declared metric, and a test
checks the proto message field by field against them (name and type), so a
new figure is its field here plus its proto field.

Pure Python, no Prometheus or protobuf: the scheduler core imports it.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field
from typing import Any

# The key of a declared field's metadata: (Kind, doc, metric).
_STAT = "kvstash.stat"
# The metric of a gauge exported under its field's own name.
_OWN_NAME = "<the field's name>"


class Kind(enum.Enum):
    COUNTER = "counter"  # cumulative since the service started; never goes down
    GAUGE = "gauge"  # a value at the time of the snapshot


@dataclass(frozen=True, slots=True)
class Stat:
    # The stats dataclass's field, and the proto message's.
    name: str
    kind: Kind
    # The metric's help text.
    doc: str
    # Exported as `<prefix><metric>` (a counter with `_total` appended by the
    # exposition); None: only GetStats reports it.
    metric: str | None
    # The field's Python type: int, float or bool.
    type: type


def counter(metric: str, doc: str) -> Any:
    """Declares a cumulative figure, 0 until counted, exported as `<metric>_total`."""
    return field(default=0, metadata={_STAT: (Kind.COUNTER, doc, metric)})


def gauge(doc: str, *, exported: bool = True) -> Any:
    """Declares a point-in-time figure (no default: the snapshot must read it),
    exported under the field's own name unless `exported` is False."""
    return field(metadata={_STAT: (Kind.GAUGE, doc, _OWN_NAME if exported else None)})


def declared(cls: type) -> tuple[Stat, ...]:
    """The stats of dataclass `cls`, in field order (a base class's first).
    TypeError names a field declared without counter() or gauge()."""
    hints = typing.get_type_hints(cls)
    stats = []
    for f in dataclasses.fields(cls):
        if _STAT not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with counter() or gauge()")
        kind, doc, metric = f.metadata[_STAT]
        stats.append(Stat(f.name, kind, doc, f.name if metric == _OWN_NAME else metric,
                          hints[f.name]))
    return tuple(stats)


def values(stats: Any) -> dict[str, Any]:
    """Field name -> value of dataclass instance `stats`: to copy counters into
    a snapshot, or a snapshot into its proto message."""
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
