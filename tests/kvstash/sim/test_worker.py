"""The simulated worker's compute thread: steps, gathers and scatters queue
on it, as on the real worker's one thread; the rest of a copy runs beside."""

from __future__ import annotations

import copy

import pytest

from kvstash.sim.cache import SimCache
from kvstash.sim.cluster import Cluster, Instance
from kvstash.sim.profile import parse_profile
from kvstash.sim.worker import SimWorker
from scheduler_svc.core.config import POLICIES, SchedulerConfig
from scheduler_svc.core.outputs import SchedulerOutput
from tests.kvstash.sim.test_cluster import TRACE
from tests.kvstash.sim.test_profile import GOOD

RAW = copy.deepcopy(GOOD)
RAW["copy"]["arena"] = {"fixed_s": 0.001, "bytes_per_s": 1e6}  # 1 KiB blocks: ~1 ms each
RAW["copy"]["grpc"] = {"fixed_s": 0.002, "bytes_per_s": 0.5e6}
RAW["copy"]["disk"] = {"fixed_s": 0.003, "bytes_per_s": 2e6}
PROFILE = parse_profile(RAW)


def test_work_starts_once_the_work_given_before_it_ended() -> None:
    worker = SimWorker(PROFILE, "arena")
    assert worker.run(1.0, 0.5) == 1.5
    assert worker.run(1.2, 0.25) == 1.75  # queued behind the first
    assert worker.run(3.0, 0.25) == 3.25  # idle meanwhile: at once


@pytest.mark.parametrize(("transport", "tier", "split"), [
    ("arena", "host", (1e-3, 0.001)),  # the gather is the copy but its cache calls
    ("grpc", "host", (1e-3, 0.002 + 2e-3 - 1e-3)),  # then the stream
    ("grpc", "disk", (1e-3, 0.002 + 2e-3 - 1e-3 + 0.003 + 0.5e-3)),
    ("arena", None, (0.0, 0.001 + 1e-3)),  # no snapshot: nothing to gather or scatter
])
def test_a_copy_is_split_between_the_thread_and_the_rest(
        transport: str, tier: str | None, split: tuple[float, float]) -> None:
    assert SimWorker(PROFILE, transport).copy_seconds(tier, 1000) == pytest.approx(split)


class Timed(Cluster):
    """Keeps each step's seconds as the engine measured them, and the profile's."""

    steps: list[tuple[float, float]]

    def _stepped(self, inst: Instance, out: SchedulerOutput, seconds: float) -> Instance:
        self.steps.append((seconds, self.profile.step.seconds(out.seqs, out.num_decodes)))
        return super()._stepped(inst, out, seconds)


def timed(policy: str) -> Timed:
    mode, reservation = POLICIES[policy]
    config = SchedulerConfig(num_blocks=64, block_size=16, max_model_len=1024,
                             vocab_size=1 << 20, max_num_seqs=16, max_num_batched_tokens=256,
                             preemption_mode=mode, reservation_policy=reservation,
                             bytes_per_block=PROFILE.bytes_per_block)
    cluster = Timed([config], PROFILE, SimCache(1 << 30, 0))
    cluster.steps = []
    result = cluster.run(TRACE)
    assert all(r.ok for r in result.records)
    return cluster


def test_a_step_waits_for_the_gathers_and_scatters_queued_before_it() -> None:
    """Offloads and restores put their copies on the thread, so some steps
    take longer than their work; without copies none does."""
    offload = timed("offload")
    late = [measured - work for measured, work in offload.steps if measured > work + 1e-9]
    assert late and min(late) >= 1e-3 - 1e-9  # at least one block's gather or scatter
    assert all(measured == pytest.approx(work) for measured, work in timed("recompute").steps)
