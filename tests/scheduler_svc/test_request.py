from __future__ import annotations

import pytest

from kvstash.common.sampling import SamplingParams
from scheduler_svc.core.request import Request, RequestStatus
from tests.scheduler_svc.factories import make_scheduler, step


def make_request(prompt: list[int]) -> Request:
    return Request.create(
        "r", prompt, SamplingParams(max_tokens=4, stop_token_ids=(7,)),
        arrival_time=0.0, arrival_seq=0, eos_token_ids=(0,),
    )


def test_prompt_is_an_immutable_copy() -> None:
    prompt = [1, 2, 3]
    req = make_request(prompt)
    prompt.append(4)  # the caller's list is not the request's
    assert req.prompt_token_ids == (1, 2, 3)
    with pytest.raises(AttributeError):
        req.prompt_token_ids = (9,)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        req.prompt_token_ids.append(4)  # type: ignore[attr-defined]


def test_outputs_never_reach_the_prompt() -> None:
    scheduler = make_scheduler()
    req = scheduler.add_request("r", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(5):
        step(scheduler, token_id=0)
    assert req.prompt_token_ids == (1, 2, 3)
    assert req.output_token_ids == [0] * 5
    assert req.status is RequestStatus.FINISHED_LENGTH


def test_stop_ids_include_eos_unless_ignored() -> None:
    assert make_request([1]).stop_ids == {0, 7}
    req = Request.create(
        "r", [1], SamplingParams(max_tokens=4, stop_token_ids=(7,), ignore_eos=True),
        arrival_time=0.0, arrival_seq=0, eos_token_ids=(0,),
    )
    assert req.stop_ids == {7}


def test_token_ids_span_prompt_and_output() -> None:
    req = make_request([1, 2, 3])
    req.output_token_ids.extend([4, 5])
    assert req.token_ids(0, 2) == [1, 2]
    assert req.token_ids(2, 5) == [3, 4, 5]
    assert req.token_ids(3, 5) == [4, 5]
    assert req.num_tokens == 5
    assert req.num_remaining_tokens == 2
