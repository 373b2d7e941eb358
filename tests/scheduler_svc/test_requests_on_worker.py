"""Which requests a lost worker takes with it (Scheduler.requests_on_worker):
those whose KV was on it or being copied to or from it. Waiting and
offloaded requests keep their state and run on the next worker."""

from __future__ import annotations

from scheduler_svc.core.config import PreemptionMode
from scheduler_svc.core.request import RequestStatus
from tests.scheduler_svc.factories import add, finish_offload, make_scheduler, step
from tests.scheduler_svc.test_preemption import status, two_decodes_then_pressure

S = RequestStatus


def test_decoding_and_copying_requests_are_on_the_worker_waiting_and_offloaded_not() -> None:
    scheduler, _ = two_decodes_then_pressure(PreemptionMode.OFFLOAD)
    add(scheduler, "c", prompt_len=2, max_tokens=2)  # queued behind the preempted one
    assert [status(scheduler, r) for r in "abc"] == [S.RUNNING_DECODE, S.OFFLOADING, S.WAITING]
    assert scheduler.requests_on_worker() == ["a", "b"]
    finish_offload(scheduler, "b", 10)
    assert status(scheduler, "b") is S.OFFLOADED
    assert scheduler.requests_on_worker() == ["a"]
    while status(scheduler, "b") is not S.RESUMING:
        step(scheduler)
    assert "b" in scheduler.requests_on_worker()


def test_a_request_part_way_through_its_prefill_is_on_the_worker() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=8)
    add(scheduler, "p", prompt_len=20)
    step(scheduler)  # its first chunk of 8
    add(scheduler, "w")
    assert (status(scheduler, "p"), status(scheduler, "w")) == (S.RUNNING_PREFILL, S.WAITING)
    assert scheduler.requests_on_worker() == ["p"]
    scheduler.check_integrity()
