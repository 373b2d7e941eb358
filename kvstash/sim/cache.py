"""The simulated cache tier's capacity (kvstash sim): snapshots in host
memory within its budget, then on disk within its budget, refused beyond."""

from __future__ import annotations


class SimCache:
    """The cache tier's capacity: snapshots in host memory, then on disk."""

    def __init__(self, host_bytes: int, disk_bytes: int) -> None:
        self.budget = {"host": host_bytes, "disk": disk_bytes}
        self.used = {"host": 0, "disk": 0}
        self.snapshots: dict[str, tuple[str, int]] = {}  # id -> (tier, bytes)

    def put(self, snapshot_id: str, num_bytes: int) -> str | None:
        for tier in ("host", "disk"):
            if self.used[tier] + num_bytes <= self.budget[tier]:
                self.used[tier] += num_bytes
                self.snapshots[snapshot_id] = (tier, num_bytes)
                return tier
        return None

    def tier(self, snapshot_id: str) -> str | None:
        held = self.snapshots.get(snapshot_id)
        return None if held is None else held[0]

    def delete(self, snapshot_id: str) -> None:
        if (held := self.snapshots.pop(snapshot_id, None)) is not None:
            self.used[held[0]] -= held[1]
