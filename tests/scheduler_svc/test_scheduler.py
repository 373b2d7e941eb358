from __future__ import annotations

import pytest

from kvstash.common.sampling import SamplingParams
from kvstash.errors import (
    AlreadyExists,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from scheduler_svc.core.config import PreemptionMode, ReservationPolicy
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from tests.scheduler_svc.factories import (
    EOS,
    add,
    ids,
    make_config,
    make_scheduler,
    run_to_end,
    step,
)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message"),
    [
        ([], 4, "request r: prompt is empty"),
        ([1], 0, "max_tokens must be positive, got 0"),
        ([1, 100], 4, "token id 100 at position 1 is outside the vocabulary [0, 100)"),
        ([1, -1], 4, "token id -1 at position 1"),
        ([1, 2.5], 4, "token id 2.5 at position 1"),
        ([1, 2, 2**40], 4, f"token id {2**40} at position 2"),
        ([1, "7"], 4, "token id '7' at position 1"),
        ([1] * 250, 10, "prompt of 250 tokens + max_tokens 10 = 260 exceeds max_model_len 256"),
        ([1] * 60, 10, "70 tokens need 18 blocks, the whole pool has 16 (64 tokens)"),
    ],
)
def test_admission_refusals_name_the_numbers(
    prompt: list[int], max_tokens: int, message: str
) -> None:
    scheduler = make_scheduler(num_blocks=16)
    with pytest.raises(InvalidArgument) as excinfo:
        scheduler.add_request("r", prompt, SamplingParams(max_tokens=max_tokens))
    assert message in str(excinfo.value)
    assert scheduler.get_request("r") is None


def test_a_stop_token_outside_the_vocabulary_is_refused() -> None:
    scheduler = make_scheduler()  # a vocabulary of 100
    with pytest.raises(InvalidArgument, match=r"stop token ids \[100, 1000\] are outside the "
                                              r"vocabulary \[0, 100\)"):
        scheduler.add_request("r", [1], SamplingParams(max_tokens=2, stop_token_ids=(7, 100, 1000)))
    assert scheduler.get_request("r") is None


@pytest.mark.parametrize(("sampling", "message"), [
    ({"temperature": -0.5}, "temperature must be finite and >= 0, got -0.5"),
    ({"temperature": float("nan")}, "temperature must be finite and >= 0, got nan"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_k": -1}, "top_k must be >= 0, got -1"),
    ({"seed": -1}, "seed must be in [0, 2**64), got -1"),
    ({"seed": 1 << 64}, "seed must be in [0, 2**64)"),
    ({"stop_token_ids": (3, -2)}, "stop_token_ids must be >= 0, got [3, -2]"),
    # Each step's plan carries them: two requests of megabytes of them broke
    # the worker's stream, and every request on it failed.
    ({"stop_token_ids": tuple(range(257))}, "stop_token_ids has 257 ids, at most 256"),
])
def test_bad_sampling_values_are_refused_naming_the_value(
    sampling: dict[str, object], message: str
) -> None:
    """The one SamplingParams type validates itself, whichever service builds it."""
    with pytest.raises(InvalidArgument) as excinfo:
        SamplingParams(max_tokens=4, **sampling)  # type: ignore[arg-type]
    assert message in str(excinfo.value)


def test_waiting_queue_is_bounded_but_preempted_requests_always_requeue() -> None:
    scheduler = make_scheduler(max_num_waiting=2, num_blocks=4, block_size=2,
                               preemption_mode=PreemptionMode.RECOMPUTE,
                               reservation_policy=ReservationPolicy.FIXED_BLOCKS,
                               fixed_blocks_per_decode=0)
    add(scheduler, "a", prompt_len=2, max_tokens=6, ignore_eos=True)
    add(scheduler, "b", prompt_len=4, max_tokens=4, ignore_eos=True, first_token=40)
    step(scheduler)  # both admitted
    add(scheduler, "c", prompt_len=2, max_tokens=2, first_token=60)
    add(scheduler, "d", prompt_len=2, max_tokens=2, first_token=70)
    with pytest.raises(ResourceExhausted, match=r"queue is full \(2 requests, max_num_waiting 2"):
        add(scheduler, "e", prompt_len=2, max_tokens=2)
    assert scheduler.get_request("e") is None
    step(scheduler)  # the pool runs short: "b" goes back to the full queue
    assert scheduler.stats().num_preemptions_recompute == 1
    assert scheduler.stats().num_waiting == 3
    run_to_end(scheduler)
    assert scheduler.stats().num_finished == 4


def test_duplicate_live_id_is_refused_and_finished_ids_are_reusable() -> None:
    scheduler = make_scheduler()
    add(scheduler, "r", max_tokens=1)
    with pytest.raises(AlreadyExists, match="request r already exists"):
        add(scheduler, "r")
    step(scheduler)
    assert scheduler.get_request("r") is None
    add(scheduler, "r")


def test_prefill_samples_then_decodes_one_token_per_step() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_len=5, max_tokens=3, first_token=10)
    output, updates = step(scheduler, token_id=7)
    [seq] = output.seqs
    assert (seq.token_ids, seq.start_pos, seq.sample) == ([10, 11, 12, 13, 14], 0, True)
    assert updates[0].new_token_ids == [7] and updates[0].finish_status is None
    req = scheduler.get_request("a")
    assert req is not None and req.status is RequestStatus.RUNNING_DECODE
    assert req.first_token_time is not None
    output, _ = step(scheduler, token_id=8)
    [seq] = output.seqs
    assert (seq.token_ids, seq.start_pos, seq.block_ids) == ([7], 5, [0, 1])
    _, updates = step(scheduler, token_id=9)
    assert updates[0].finish_status is RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [7, 8, 9]
    stats = scheduler.stats()
    assert stats.num_finished == 1
    # Freed, full blocks stay cached: [10..13] and [14, 7, 8, 9] minus the uncomputed last.
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_total_blocks
    assert stats.num_evictable_blocks == 1


@pytest.mark.parametrize(
    ("sampling", "tokens", "status"),
    [
        ({"max_tokens": 5}, [3, EOS], RequestStatus.FINISHED_STOPPED),
        ({"max_tokens": 5, "ignore_eos": True}, [3, EOS, 3, 3, 3], RequestStatus.FINISHED_LENGTH),
        ({"max_tokens": 5, "stop_token_ids": (9,)}, [3, 9], RequestStatus.FINISHED_STOPPED),
    ],
)
def test_finish_on_stop_eos_and_length(
    sampling: dict, tokens: list[int], status: RequestStatus
) -> None:
    scheduler = make_scheduler()
    req = scheduler.add_request("a", [1, 2], SamplingParams(**sampling))
    for token in tokens:
        _, updates = step(scheduler, token_id=token)
    assert updates[-1].finish_status is status
    assert req.output_token_ids == tokens  # the stop token is kept
    assert req.status is status


def test_decodes_are_scheduled_before_chunked_prefill_under_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    add(scheduler, "a", prompt_len=2, max_tokens=20, ignore_eos=True)
    add(scheduler, "b", prompt_len=2, max_tokens=20, ignore_eos=True, first_token=30)
    step(scheduler)
    add(scheduler, "long", prompt_len=20, max_tokens=2, first_token=50)
    chunks = []
    for _ in range(4):
        output, _ = step(scheduler)
        assert ids(output.seqs)[:2] == ["a", "b"]
        assert output.num_scheduled_tokens <= 8
        chunks += [(s.start_pos, len(s.token_ids), s.sample) for s in output.seqs[2:]]
    # 6 tokens per step left for the prompt: chunks of 6, 6, 6, 2; only the last samples.
    assert chunks[:4] == [(0, 6, False), (6, 6, False), (12, 6, False), (18, 2, True)]


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i, name in enumerate("abc"):
        add(scheduler, name, max_tokens=5, ignore_eos=True, first_token=10 + 20 * i)
    output, _ = step(scheduler)
    assert ids(output.seqs) == ["a", "b"]
    assert scheduler.stats().num_waiting == 1


def test_update_ignores_requests_aborted_meanwhile() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a")
    add(scheduler, "b", first_token=40)
    output = scheduler.schedule()
    scheduler.abort("a")
    add(scheduler, "a", first_token=60)  # same id, new request: not the one scheduled
    updates = scheduler.update(output, {"a": 5, "b": 6})
    assert [(u.request_id, u.new_token_ids) for u in updates] == [("b", [6])]
    req = scheduler.get_request("a")
    assert req is not None and req.status is RequestStatus.WAITING and req.output_token_ids == []
    scheduler.check_integrity()


def test_update_refuses_stale_output_and_missing_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a")
    first = scheduler.schedule()
    scheduler.schedule()  # the first step never ran
    with pytest.raises(FailedPrecondition, match="output of step 1 is stale"):
        scheduler.update(first, {"a": 1})
    scheduler2 = make_scheduler()
    add(scheduler2, "a")
    output = scheduler2.schedule()
    with pytest.raises(InvalidArgument, match="no sampled token for request a"):
        scheduler2.update(output, {})


def test_an_update_missing_one_token_changes_nothing() -> None:
    """A decode and a prefill sampled, one token missing: refused before any
    state moves, so the same output then applies whole."""
    scheduler = make_scheduler()
    add(scheduler, "a")
    step(scheduler)  # a decodes from here
    add(scheduler, "b", first_token=40)
    output = scheduler.schedule()
    a, b = scheduler.get_request("a"), scheduler.get_request("b")
    assert a is not None and b is not None
    before = (a.num_computed_tokens, list(a.output_token_ids), b.status, b.num_computed_tokens)
    for sampled, missing in (({"b": 7}, "a"), ({"a": 5}, "b")):
        with pytest.raises(InvalidArgument, match=f"no sampled token for request {missing}"):
            scheduler.update(output, sampled)
        assert (a.num_computed_tokens, a.output_token_ids, b.status,
                b.num_computed_tokens) == before
        scheduler.check_integrity()
    updates = scheduler.update(output, {"a": 5, "b": 7})
    assert {u.request_id: u.new_token_ids for u in updates} == {"a": [5], "b": [7]}
    scheduler.check_integrity()


def test_a_sampled_token_outside_the_vocabulary_is_refused_changing_nothing() -> None:
    scheduler = make_scheduler(vocab_size=100)
    add(scheduler, "a")
    output = scheduler.schedule()
    for token in (100, -1):
        with pytest.raises(InvalidArgument, match=f"sampled token {token} for request a"):
            scheduler.update(output, {"a": token})
    req = scheduler.get_request("a")
    assert req is not None and req.output_token_ids == [] and req.num_computed_tokens == 0
    assert [u.new_token_ids for u in scheduler.update(output, {"a": 99})] == [[99]]


def test_abort_unknown_or_finished_is_not_found() -> None:
    scheduler = make_scheduler()
    with pytest.raises(NotFound, match="request x is unknown or already finished"):
        scheduler.abort("x")
    add(scheduler, "a", max_tokens=1)
    step(scheduler)
    with pytest.raises(NotFound):
        scheduler.abort("a")


@pytest.mark.parametrize("num_steps", [0, 1, 2])
def test_abort_waiting_prefilling_decoding_frees_everything(num_steps: int) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, "a", prompt_len=12, max_tokens=5)
    for _ in range(num_steps):
        step(scheduler)
    scheduler.abort("a")
    scheduler.check_integrity()
    stats = scheduler.stats()
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_total_blocks
    assert scheduler.get_request("a") is None and scheduler.is_idle


def test_identical_prompts_share_prefix_blocks() -> None:
    scheduler = make_scheduler(block_size=2)
    add(scheduler, "a", prompt_len=6, max_tokens=5, ignore_eos=True)
    step(scheduler)
    add(scheduler, "b", prompt_len=6, max_tokens=5, ignore_eos=True)
    output, _ = step(scheduler)
    a, b = scheduler.get_request("a"), scheduler.get_request("b")
    assert a is not None and b is not None
    assert b.block_ids[:2] == a.block_ids[:2]  # [10, 11] [12, 13] computed by "a"
    [b_seq] = [s for s in output.seqs if s.request_id == "b"]
    assert (b_seq.start_pos, b_seq.token_ids) == (4, [14, 15])
    # Every update of "b", not only the finishing one, says what it found cached.
    updates = []
    while scheduler.has_unfinished_requests:
        updates += step(scheduler)[1]
    cached = {u.request_id: set() for u in updates}
    for u in updates:
        cached[u.request_id].add(u.num_cached_tokens)
        assert u.usage is None or u.usage.num_cached_tokens == u.num_cached_tokens
    assert cached == {"a": {0}, "b": {4}}


def test_check_integrity_catches_corrupted_scheduler_state() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", max_tokens=5)
    add(scheduler, "b", max_tokens=5, first_token=50)
    step(scheduler)
    scheduler.check_integrity()
    a = scheduler.get_request("a")
    assert a is not None
    a.status = RequestStatus.WAITING  # a status that disagrees with its queue
    with pytest.raises(IntegrityError, match="request a in decoding has status waiting"):
        scheduler.check_integrity()
    a.status = RequestStatus.RUNNING_DECODE
    a.block_ids.append(a.block_ids[0])  # a block held twice with one reference
    with pytest.raises(IntegrityError, match="ref_cnt 1 but 2 block tables hold it"):
        scheduler.check_integrity()
    a.block_ids.pop()
    scheduler.life.decoding["a-again"] = a  # in its queue twice
    with pytest.raises(IntegrityError, match="request a is in both decoding and decoding"):
        scheduler.check_integrity()
    del scheduler.life.decoding["a-again"]
    del scheduler.life.decoding["a"]  # lost
    with pytest.raises(IntegrityError, match=r"requests \['a'\] are in no queue"):
        scheduler.check_integrity()


def test_stats_count_states() -> None:
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=4)
    add(scheduler, "a", prompt_len=6)
    add(scheduler, "b")
    step(scheduler)
    stats = scheduler.stats()
    assert (stats.num_running_prefill, stats.num_running_decode, stats.num_waiting) == (1, 0, 1)
    assert stats.num_steps == 1 and stats.num_total_blocks == 64 and stats.block_size == 4


def test_stats_count_tokens_usage_and_queue_time() -> None:
    now = [0.0]
    scheduler = Scheduler(make_config(max_num_seqs=1), clock=lambda: now[0])
    add(scheduler, "a", prompt_len=6, max_tokens=3)
    add(scheduler, "b", prompt_len=5, max_tokens=2)
    now[0] = 1.0
    step(scheduler)  # a: prefill + first token; b waits for the seat
    stats = scheduler.stats()
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (6, 1)
    assert stats.kv_usage_ratio == 2 / 64  # a's 7 positions in blocks of 4
    assert not stats.cache_available
    while scheduler.has_unfinished_requests:
        step(scheduler)
    stats = scheduler.stats()
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (11, 5)
    assert stats.kv_usage_ratio == 0
    scheduler.set_cache_available(True)
    assert scheduler.stats().cache_available


def test_first_scheduled_time_is_the_first_admission() -> None:
    now = [0.0]
    scheduler = Scheduler(make_config(), clock=lambda: now[0])
    req = scheduler.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    assert req.first_scheduled_time is None
    now[0] = 2.5
    step(scheduler)
    assert req.first_scheduled_time == 2.5 and req.arrival_time == 0.0


def test_reset_prefix_cache_stops_prefix_hits() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_len=12, max_tokens=2)
    run_to_end(scheduler)
    assert scheduler.stats().num_evictable_blocks > 0
    assert scheduler.reset_prefix_cache() > 0
    stats = scheduler.stats()
    assert (stats.num_free_blocks, stats.num_evictable_blocks) == (stats.num_total_blocks, 0)
    add(scheduler, "b", prompt_len=12, max_tokens=2)  # the same prompt as "a"
    output, _ = step(scheduler)
    [seq] = output.seqs
    assert seq.start_pos == 0 and len(seq.token_ids) == 12  # prefilled from scratch
