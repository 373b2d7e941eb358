"""Lifecycle: one status writer, legal transitions only, copies that own their blocks."""

from __future__ import annotations

import ast

import pytest

from kvstash.errors import FailedPrecondition, IntegrityError, NotFound
from scheduler_svc.core.config import PreemptionMode
from scheduler_svc.core.outputs import OffloadCommand
from scheduler_svc.core.request import RequestStatus
from tests.scheduler_svc.factories import add, finish_offload, run_to_end, step
from tests.scheduler_svc.test_preemption import two_decodes_then_pressure
from tests.test_boundaries import REPO

S = RequestStatus
PACKAGE = REPO / "scheduler_svc"


def status_writers() -> list[str]:
    """file:line of every assignment to a `.status` attribute in scheduler_svc."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
            found += [f"{path.relative_to(PACKAGE)}:{node.lineno}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr == "status"]
    return found


def test_move_is_the_only_status_writer() -> None:
    writers = status_writers()
    assert len(writers) == 1 and writers[0].startswith("core/lifecycle.py:"), writers


@pytest.mark.parametrize(("start", "to"), [
    (S.WAITING, S.RUNNING_DECODE),  # a prefill never skipped
    (S.WAITING, S.OFFLOADING),
    (S.RUNNING_DECODE, S.RESUMING),
    (S.RUNNING_DECODE, S.RUNNING_PREFILL),
])
def test_a_move_that_is_no_transition_is_refused_and_changes_nothing(
    start: S, to: S
) -> None:
    scheduler, _ = two_decodes_then_pressure(PreemptionMode.RECOMPUTE)
    req = next(r for r in scheduler.life.requests.values() if r.status is start)
    with pytest.raises(IntegrityError, match=f"{start.value} -> {to.value} is no transition"):
        scheduler.life.move(req, to)
    assert req.status is start
    scheduler.check_integrity()


def test_an_aborted_request_leaves_at_once_and_its_id_is_reusable_during_its_copy() -> None:
    scheduler, output = two_decodes_then_pressure(PreemptionMode.OFFLOAD)
    [offload] = output.offloads
    held = list(offload.block_ids)
    scheduler.abort("b")
    assert scheduler.get_request("b") is None and scheduler.stats().num_offloaded == 0
    add(scheduler, "b", prompt_len=2, max_tokens=2, first_token=70)  # the same id, anew
    step(scheduler)
    assert all(scheduler.kv.pool.ref_cnt(block) >= 1 for block in held)  # pinned by the copy
    assert not scheduler.is_idle
    scheduler.finish_offload(offload, 10)  # lands for the old request, not the new one
    new_b = scheduler.get_request("b")
    assert new_b is not None and new_b.snapshot is None and new_b.status is not S.OFFLOADED
    assert scheduler.take_snapshots_to_delete() == [offload.snapshot_id]
    scheduler.check_integrity()
    scheduler.abort("a")
    scheduler.abort("b")
    stats = scheduler.stats()
    assert scheduler.is_idle and stats.num_free_blocks + stats.num_evictable_blocks == 4


def test_a_copy_lands_once() -> None:
    scheduler, _ = two_decodes_then_pressure(PreemptionMode.OFFLOAD)
    finish_offload(scheduler, "b", 10)
    with pytest.raises(FailedPrecondition, match=r"no copy of snapshot \S+ is in flight"):
        finish_offload(scheduler, "b", 10)
    stranger = OffloadCommand("a", "nobody.a.0", [0], 1)
    with pytest.raises(FailedPrecondition, match=r"nobody\.a\.0"):
        scheduler.finish_offload(stranger, 10)
    scheduler.check_integrity()


def test_abort_of_an_unknown_or_finished_request_is_not_found() -> None:
    scheduler, _ = two_decodes_then_pressure(PreemptionMode.RECOMPUTE)
    with pytest.raises(NotFound, match="request zz is unknown or already finished"):
        scheduler.abort("zz")
    run_to_end(scheduler)
    with pytest.raises(NotFound):
        scheduler.abort("a")
