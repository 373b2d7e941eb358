"""The P/D manager's place in the core (pd.py): only a P/D role has one, each
role answers only its own side's calls, and which requests go to a decode
instance is kept by the manager, dropped when they leave."""

from __future__ import annotations

import pytest

from kvstash.common.sampling import SamplingParams
from kvstash.errors import FailedPrecondition, IntegrityError
from scheduler_svc.core import scheduler as scheduler_module
from scheduler_svc.core.config import Role
from scheduler_svc.core.outputs import OffloadCommand
from scheduler_svc.core.request import RequestStatus, RequestUsage
from scheduler_svc.core.scheduler import Scheduler
from tests.scheduler_svc.factories import make_scheduler, run_to_end, step

S = RequestStatus
PROMPT = [5, 6, 7, 8, 9, 10]


def greedy(max_tokens: int, stop: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop)


def test_a_mixed_scheduler_never_builds_or_enters_a_pd_manager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_manager(*args: object) -> None:
        raise AssertionError("a MIXED scheduler built a P/D manager")

    monkeypatch.setattr(scheduler_module, "PdManager", no_manager)
    core = make_scheduler()
    with pytest.raises(FailedPrecondition, match="role mixed"):
        core.pd  # noqa: B018
    with pytest.raises(FailedPrecondition, match="role mixed"):
        core.add_request("a", PROMPT, greedy(4), handoff=True)
    assert core.get_request("a") is None and core.is_idle
    core.add_request("a", PROMPT, greedy(4))
    run_to_end(core)  # step() checks integrity every step
    assert core.stats().num_finished == 1


def test_each_role_answers_only_its_own_side() -> None:
    prefill = make_scheduler(role=Role.PREFILL)
    with pytest.raises(FailedPrecondition, match="only a decode instance reserves"):
        prefill.pd.reserve("r", PROMPT, greedy(4))
    with pytest.raises(FailedPrecondition, match="only a decode instance decodes"):
        prefill.pd.start_remote_decode("r", "pre.r.0", 6, 3)
    assert prefill.get_request("r") is None and prefill.is_idle

    decode = make_scheduler(role=Role.DECODE)
    with pytest.raises(FailedPrecondition, match="only a prefill instance hands"):
        decode.add_request("a", PROMPT, greedy(4), handoff=True)
    assert decode.get_request("a") is None and decode.is_idle
    usage = RequestUsage(6, 2, 0, 0, 0, None)
    for call in (lambda: decode.pd.finish_handoff(OffloadCommand("a", "s", [0], 4), 10),
                 lambda: decode.pd.remote_tokens("a", [1]),
                 lambda: decode.pd.finish_remote("a", [1], True, usage),
                 lambda: decode.pd.take_back("a")):
        with pytest.raises(FailedPrecondition, match="only a prefill instance hands"):
            call()
    # Both still serve requests of their own.
    for core in (prefill, decode):
        core.add_request("local", PROMPT, greedy(3))
        run_to_end(core)
        assert core.stats().num_finished == 1 and core.is_idle


def handoff_core(**overrides: object) -> Scheduler:
    return make_scheduler(role=Role.PREFILL, **overrides)


def test_a_request_to_hand_off_is_kept_until_its_copy_starts() -> None:
    core = handoff_core(max_num_batched_tokens=8)
    pd = core.pd
    core.add_request("a", [1] * 10, greedy(4), handoff=True)  # two chunks
    core.add_request("b", PROMPT, greedy(4))
    assert pd.will_hand_off("a") and not pd.will_hand_off("b")
    assert list(pd.awaiting_prefill) == ["a"] and not pd.to_hand_off
    step(core)  # a's first chunk
    assert list(pd.awaiting_prefill) == ["a"] and not pd.to_hand_off
    step(core)  # its last: the first token sampled
    assert not pd.awaiting_prefill and list(pd.to_hand_off) == ["a"] and pd.will_hand_off("a")
    output, _ = step(core)
    assert [c.request_id for c in output.handoffs] == ["a"]
    assert not pd.will_hand_off("a") and not pd.awaiting_prefill and not pd.to_hand_off


@pytest.mark.parametrize("when", [S.WAITING, S.RUNNING_PREFILL, S.RUNNING_DECODE])
def test_an_aborted_request_leaves_the_handoff_sets(when: RequestStatus) -> None:
    core = handoff_core(max_num_batched_tokens=8)
    core.add_request("a", [1] * 10, greedy(4), handoff=True)
    while (req := core.get_request("a")) is not None and req.status is not when:
        step(core)
    core.abort("a")
    core.check_integrity()
    assert not core.pd.will_hand_off("a")
    assert not core.pd.awaiting_prefill and not core.pd.to_hand_off
    output, _ = step(core)
    assert output.handoffs == [] and core.is_idle


@pytest.mark.parametrize("sampling", [greedy(1), greedy(4, stop=(1,))],
                         ids=["max_tokens_1", "stop_token"])
def test_a_request_its_first_token_ends_leaves_the_handoff_sets(
    sampling: SamplingParams
) -> None:
    core = handoff_core()
    core.add_request("a", PROMPT, sampling, handoff=True)
    _, [update] = step(core, token_id=1)
    assert update.finish_status is not None
    assert not core.pd.awaiting_prefill and not core.pd.to_hand_off
    output, _ = step(core)
    assert output.handoffs == [] and core.is_idle


def test_integrity_catches_a_request_the_manager_kept_past_its_end() -> None:
    core = handoff_core()
    core.add_request("a", PROMPT, greedy(4), handoff=True)
    step(core)
    core.life.abort("a")  # behind the manager's back: it still holds "a"
    with pytest.raises(IntegrityError, match="request a, to be handed off"):
        core.check_integrity()


def test_integrity_catches_pd_state_in_the_wrong_role() -> None:
    decode = make_scheduler(role=Role.DECODE)
    decode.add_request("a", PROMPT, greedy(4))
    decode.pd.awaiting_prefill["a"] = decode.life.requests["a"]
    with pytest.raises(IntegrityError, match="a decode scheduler is to hand off"):
        decode.check_integrity()
