"""One replay run: a stack started for a policy (or one already running),
warmed up, the trace replayed through it, its counters taken before and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from bench.replay.drive import Occupancy, Sampler, Sender, grpc_sender, http_sender, replay
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.client import Client
from kvstash.launch.stack import StackConfig, running_stack
from kvstash.v1 import scheduler_pb2
from kvstash.workload import plots
from kvstash.workload.metrics import RequestRecord
from kvstash.workload.trace import Trace
from scheduler_svc.core.config import POLICIES as CORE_POLICIES
from scheduler_svc.core.config import ReservationPolicy

# The scheduler's named policies (scheduler_svc/core/config.py), as the
# stack's flags: its preemption mode and, where not the default, reservation.
POLICIES: dict[str, tuple[str, tuple[str, ...]]] = {
    name: (mode.value, () if reservation is ReservationPolicy.NEW_TOKEN_RATIO
           else ("--reservation", reservation.value))
    for name, (mode, reservation) in CORE_POLICIES.items()
}
DEFAULT_POLICIES = ("recompute", "offload", "auto", "auto-fixed")
OnDone = Callable[[RequestRecord], None] | None
# SchedulerStats counters a run reports, as differences over the replay.
COUNTERS = ("num_preemptions_offload", "num_preemptions_recompute", "num_recomputed_tokens",
            "bytes_offloaded", "bytes_restored", "num_offload_failures",
            "num_restore_failures", "num_prompt_tokens", "num_generation_tokens",
            "num_prefix_query_tokens", "num_prefix_hit_tokens", "num_steps", "num_handoffs")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a run sends: a scheduler (and its cache), and smg's URL for HTTP."""

    scheduler: str
    cache: str | None = None
    http_url: str | None = None  # None: kvstash's gRPC API
    model: str = "tiny"


@dataclass(slots=True)
class RunResult:
    policy: str
    rate: float  # mean arrivals/s of the slice as replayed
    records: list[RequestRecord]
    counters: dict[str, int]
    occupancy: list[Occupancy]

    def plotted(self) -> plots.Run:
        o = self.occupancy
        return plots.Run(self.policy, self.rate, self.records, [s.t_s for s in o],
                         [s.used_blocks / s.total_blocks for s in o],
                         [s.cache_memory_bytes + s.cache_disk_bytes for s in o])


def policy_config(base: StackConfig, policy: str, via_http: bool) -> StackConfig:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    mode, args = POLICIES[policy]
    return dataclasses.replace(base, preemption_mode=mode, gateway=via_http,
                               scheduler_args=(*base.scheduler_args, *args))


@contextlib.contextmanager
def policy_stack(base: StackConfig, policy: str, via_http: bool) -> Iterator[Endpoint]:
    with running_stack(policy_config(base, policy, via_http)) as stack:
        url = stack.gateway.url if stack.gateway is not None else None
        yield Endpoint(stack.address, stack.cache.address, url, base.model)


def counters(stats: scheduler_pb2.SchedulerStats) -> dict[str, int]:
    return {name: int(getattr(stats, name)) for name in COUNTERS}


async def run_once(endpoint: Endpoint, policy: str, trace: Trace,
                   prompts: Sequence[list[int]], on_done: OnDone = None,
                   timeout_s: float | None = None) -> RunResult:
    """Warms the stack up with one short request, then replays the trace."""
    async with Client(endpoint.scheduler) as client, contextlib.AsyncExitStack() as stack:
        cache = None
        if endpoint.cache is not None:
            cache = await stack.enter_async_context(CacheClient(endpoint.cache))
        send: Sender = (grpc_sender(client) if endpoint.http_url is None
                        else http_sender(endpoint.http_url, endpoint.model))
        await client.complete(list(prompts[0][:8]) or [1], max_tokens=2, ignore_eos=True)
        before = counters(await client.stats())
        async with Sampler(client, cache) as sampler:
            records = await replay(trace, prompts, send, on_done or (lambda _: None), timeout_s)
        after = counters(await client.stats())
    delta = {name: after[name] - before[name] for name in COUNTERS}
    return RunResult(policy, trace.rate, records, delta, sampler.samples)


async def pool_tokens(address: str) -> int:
    """The tokens the KV pool of the scheduler at `address` holds."""
    async with Client(address) as client:
        stats = await client.stats()
    return stats.num_total_blocks * stats.block_size


def run_policy(base: StackConfig, policy: str, trace: Trace, prompts: Sequence[list[int]],
               via_http: bool = False, on_done: OnDone = None,
               timeout_s: float | None = None) -> RunResult:
    with policy_stack(base, policy, via_http) as endpoint:
        return asyncio.run(run_once(endpoint, policy, trace, prompts, on_done, timeout_s))
