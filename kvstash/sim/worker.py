"""An instance's simulated worker (kvstash sim): when its steps and copies end.

The real worker runs its steps and the memory copies of its transfers (a
snapshot's gather out of the KV blocks, its scatter back in) on one compute
thread, in the order they reach it (gpu_worker/transfer.py); the rest of a
copy (cache calls, streaming, the cache's disk) runs beside. So a gather
waits for the step in flight, and the next step waits for the gather. Here
that thread is a queue: work starts once the work given before it ended.

    step     on the thread, for the profile's step seconds
    put      the gather on the thread, then the rest of its path beside
    restore  the rest of its path first (the fetch), then the scatter

A gather or scatter moves its bytes at the arena path's rate: on that path
it is the whole copy but the cache calls (the profile's fixed seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstash.sim.profile import CostProfile


@dataclass(slots=True)
class SimWorker:
    profile: CostProfile
    transport: str  # "arena" (co-located with the cache) or "grpc"
    free_s: float = 0.0  # when the compute thread will have done all it was given

    def run(self, now: float, seconds: float) -> float:
        """Gives the compute thread `seconds` of work at `now`; when it ends."""
        self.free_s = max(now, self.free_s) + seconds
        return self.free_s

    def copy_seconds(self, tier: str | None, num_bytes: int) -> tuple[float, float]:
        """A snapshot's copy between this worker and the cache, whose `tier`
        holds it (or takes it; None: neither): its seconds on the compute
        thread, and beside it (the path's, and the disk's where it is there)."""
        profile = self.profile
        total = profile.copy[self.transport].seconds(num_bytes)
        if tier == "disk":
            total += profile.copy["disk"].seconds(num_bytes)
        on_thread = 0.0 if tier is None else min(
            total, num_bytes / profile.copy["arena"].bytes_per_s)
        return on_thread, total - on_thread
