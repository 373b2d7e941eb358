"""How a simulated cluster picks the instance for each arriving request:
round-robin, least-load (fewest requests held), or prefix-aware (a model of
smg's cache-aware policy). A router is made fresh for each run
(`ROUTERS[name]()`), so one keeps what it learns for one run only."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from kvstash.workload.trace import TraceRequest


class Routed(Protocol):
    """What a router reads of an instance."""

    name: str
    held: set[str]  # request ids routed there and not ended


R = TypeVar("R", bound=Routed)


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def __call__(self, instances: Sequence[R], request: TraceRequest) -> R:
        return instances[next(self._turn) % len(instances)]


def least_load(instances: Sequence[R], request: TraceRequest) -> R:
    return min(instances, key=lambda inst: len(inst.held))


class PrefixAware:
    """Like smg's cache-aware policy: each instance remembers the prompt
    prefixes (runs of leading hash ids) routed to it; a request goes to the
    instance that holds the longest run of its own when that covers at least
    `threshold` of its ids and that instance holds at most `balance` requests
    more than the least loaded one, else to the least loaded. (A model of the
    router, not smg itself: no eviction of what an instance remembers.)"""

    def __init__(self, threshold: float = 0.5, balance: int = 32) -> None:
        self.threshold, self.balance = threshold, balance
        self.seen: dict[str, set[int]] = {}

    def __call__(self, instances: Sequence[R], request: TraceRequest) -> R:
        keys, key = [], 0
        for hash_id in request.hash_ids:  # one key per leading run: chained
            key = hash((key, hash_id))
            keys.append(key)
        least = least_load(instances, request)
        best, best_run = least, 0
        for inst in instances:
            seen = self.seen.setdefault(inst.name, set())
            run = next((i for i, k in enumerate(keys) if k not in seen), len(keys))
            if run > best_run:
                best, best_run = inst, run
        covered = best_run >= self.threshold * len(keys)
        choice = best if covered and len(best.held) <= len(least.held) + self.balance else least
        self.seen[choice.name].update(keys)
        return choice


ROUTERS: dict[str, Callable[[], Callable[..., Any]]] = {
    "round-robin": RoundRobin, "least-load": lambda: least_load, "prefix-aware": PrefixAware}
