"""P/D disaggregation in the scheduler core (pd.py, lifecycle.py, admission.py).

    decode instance   pd.reserve() under admission's rule, expiry at schedule(),
                      pd.start_remote_decode() + finish_restore(), then decodes
    prefill instance  add_request(handoff=True) -> out.handoffs -> pd.finish_handoff();
                      pd.remote_tokens / finish_remote / take_back while HANDED_OFF
    both              `PD` wires a prefill core and a decode core as their
                      engines do, in memory: each core has a FakeWorker whose
                      KV slots hold the tokens they encode, the cache service
                      is a dict snapshot_id -> those tokens (a restore consumes
                      it), and the model is fakes.next_token, a hash of the
                      whole prefix. A wrong block table, snapshot or restore
                      changes the tokens generated.

Every scenario checks each core's integrity after every step and transition.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstash.common.sampling import SamplingParams
from kvstash.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvstashError,
    NotFound,
)
from scheduler_svc.core.config import PreemptionMode, Role, SchedulerConfig
from scheduler_svc.core.outputs import (
    OffloadCommand,
    RequestUpdate,
    RestoreCommand,
    SchedulerOutput,
)
from scheduler_svc.core.request import RequestStatus, RequestUsage
from scheduler_svc.core.scheduler import Scheduler
from tests.scheduler_svc.conftest import PROFILE
from tests.scheduler_svc.factories import EOS, make_config
from tests.scheduler_svc.fakes import FakeWorker, next_token, reference_output

S = RequestStatus
VOCAB = 100  # make_config's vocab_size
BYTES_PER_BLOCK = 64


class Clock:
    """The injected clock: tests move `now` by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def pd_config(**overrides: object) -> SchedulerConfig:
    """make_config for a decode instance, with admission (so reserve) keeping
    back every block a decode may still need: new_token_ratio frozen at 1.0."""
    values: dict[str, object] = {"init_new_token_ratio": 1.0, "min_new_token_ratio_factor": 1.0,
                                 "role": Role.DECODE}
    values.update(overrides)
    return make_config(**values)


def prefill_config(**overrides: object) -> SchedulerConfig:
    """make_config for a prefill instance."""
    return make_config(role=Role.PREFILL, **overrides)


def prompt_of(num_tokens: int, seed: int = 0) -> list[int]:
    return [1 + (seed * 7 + i * 3) % (VOCAB - 1) for i in range(num_tokens)]


# A stop token the requests that need one name (never their first token here).
STOP = 40


def greedy(max_tokens: int, *, ignore_eos: bool = True, stop: Sequence[int] = ()) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=tuple(stop))


def expected(prompt: Sequence[int], sampling: SamplingParams) -> list[int]:
    """What the fake model generates for the request, run alone: the oracle."""
    return reference_output(prompt, sampling, (EOS,), VOCAB)


def pool_is_clean(core: Scheduler) -> bool:
    """Every block free or an evictable cached prefix: nothing held, nothing leaked."""
    pool = core.kv.pool
    return pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks


def status(core: Scheduler, request_id: str) -> RequestStatus | None:
    req = core.get_request(request_id)
    return None if req is None else req.status


class Side:
    """One core, its fake worker, and the true tokens of its requests."""

    def __init__(self, config: SchedulerConfig, clock: Clock | None = None) -> None:
        self.core = Scheduler(config, clock=clock or Clock())
        self.worker = FakeWorker(config.num_blocks, config.block_size, config.vocab_size)
        # Prompt + output of each request, as far as this side knows them.
        self.truth: dict[str, list[int]] = {}
        # Blocks that copies in flight read (offloads, handoffs) and write (restores).
        self.reading: Counter[int] = Counter()
        self.writing: set[int] = set()
        # Snapshots its restores read, for the tests that drive one side alone.
        self.cache: dict[str, list[int | None]] = {}

    def step(
        self, on_output: Callable[[SchedulerOutput], None] | None = None
    ) -> tuple[SchedulerOutput, list[RequestUpdate]]:
        """schedule(), the fake model's tokens, update(); `on_output` sees the
        output before the step runs (to start its copies)."""
        core = self.core
        output = core.schedule()
        core.check_integrity()
        if on_output is not None:
            on_output(output)
        self._check_not_busy(output)
        sampled = self.worker.execute(output, self.truth)
        updates = core.update(output, sampled)
        core.check_integrity()
        for update in updates:
            self.truth[update.request_id].extend(update.new_token_ids)
        return output, updates

    def land_restores(self, output: SchedulerOutput) -> None:
        """Lands the output's restores at once from `cache` (failing the ones it lacks)."""
        for cmd in output.restores:
            kv = self.cache.pop(cmd.snapshot_id, None)
            if kv is not None:
                self.worker.write(cmd.block_ids, 0, [t for t in kv if t is not None])
            self.core.finish_restore(cmd, None if kv is None else len(kv))
            self.core.check_integrity()

    def run_to_end(self) -> None:
        while self.core.has_unfinished_requests:
            self.step(self.land_restores)

    def _check_not_busy(self, output: SchedulerOutput) -> None:
        """No step writes a block a copy reads, or touches one a restore writes."""
        size = self.core.config.block_size
        for seq in output.seqs:
            end = seq.start_pos + len(seq.token_ids)
            written = seq.block_ids[seq.start_pos // size : -(-end // size)]
            busy = self.writing.intersection(seq.block_ids) | set(self.reading).intersection(
                written)
            assert not busy, f"{seq.request_id} uses blocks {busy} under a copy"


# ----------------------------------------------------------------- decode side


def reserve(core: Scheduler, request_id: str, prompt_len: int, max_tokens: int,
            seed: int = 0) -> bool:
    accepted = core.pd.reserve(request_id, prompt_of(prompt_len, seed), greedy(max_tokens))
    core.check_integrity()
    return accepted


def start_remote(side: Side, request_id: str, land: bool = True,
                 snapshot_id: str | None = None) -> RestoreCommand:
    """What a prefill instance sends for a RESERVED request: its prompt's KV
    in a snapshot and its first token; then (`land`) the copy lands."""
    core = side.core
    req = core.get_request(request_id)
    assert req is not None
    prompt = list(req.prompt_token_ids)
    first = next_token(prompt, VOCAB)
    snapshot_id = snapshot_id or f"pre.{request_id}.0"
    cmd = core.pd.start_remote_decode(request_id, snapshot_id, len(prompt), first)
    core.check_integrity()
    assert req.status is S.RESUMING and cmd.block_ids == req.block_ids
    side.truth[request_id] = [*prompt, first]
    if land:
        side.worker.write(cmd.block_ids, 0, prompt)
        core.finish_restore(cmd, len(cmd.block_ids) * BYTES_PER_BLOCK)
        core.check_integrity()
        assert req.status is S.RUNNING_DECODE and req.output_token_ids == [first]
    return cmd


def test_reserve_keeps_back_running_decodes_and_earlier_reservations() -> None:
    side = Side(pd_config(num_blocks=12))  # blocks of 4 tokens
    core = side.core

    def free() -> int:
        return core.stats().num_free_blocks

    assert reserve(core, "a", 4, 16)  # 1 block; 16 tokens to go keep 4 back
    assert free() == 11 and core.admission.blocks_kept_back() == 4
    start_remote(side, "a")  # decoding: 15 tokens to go, still 4 blocks
    assert core.admission.blocks_kept_back() == 4
    assert reserve(core, "b", 8, 8, seed=1)  # 2 blocks + its 2 + a's 4 = 8 <= 11
    assert free() == 9 and core.admission.blocks_kept_back() == 6
    # 1 block + its 3 + 6 kept back = 10 > 9. Without a's growth (4 blocks) it would fit.
    assert not reserve(core, "c", 4, 12, seed=2)
    assert core.get_request("c") is None and free() == 9
    assert core.admission.blocks_kept_back() == 6
    assert reserve(core, "c", 4, 8, seed=2)  # 1 + 2 + 6 = 9: exactly fits
    assert free() == 8 == core.admission.blocks_kept_back()
    assert not reserve(core, "d", 1, 2, seed=3)  # every free block is spoken for
    stats = core.stats()
    assert (stats.num_reservations_accepted, stats.num_reservations_refused) == (3, 2)
    assert (stats.num_reserved, stats.num_running_decode) == (2, 1)
    # The prompt's blocks are held: RESERVED requests own them.
    b, c = core.get_request("b"), core.get_request("c")
    assert b is not None and c is not None
    assert (b.status, len(b.block_ids), c.status, len(c.block_ids)) == (
        S.RESERVED, 2, S.RESERVED, 1)
    assert not set(b.block_ids) & set(c.block_ids)


def test_an_earlier_reservation_counts_until_it_is_released() -> None:
    core = Side(pd_config(num_blocks=7)).core
    assert reserve(core, "x", 8, 8)  # 2 blocks + 2 kept back
    # 2 blocks + its 2 + x's 2 = 6 > 5; x's prompt blocks alone would leave room.
    assert not reserve(core, "y", 8, 8, seed=1)
    core.abort("x")
    core.check_integrity()
    assert core.stats().num_free_blocks == 7
    assert reserve(core, "y", 8, 8, seed=1)
    assert core.stats().num_reservations_accepted == 2


@pytest.mark.parametrize(("ratio", "accepted"), [(1.0, False), (0.5, True)])
def test_the_decode_growth_kept_back_follows_new_token_ratio(ratio: float, accepted: bool) -> None:
    side = Side(pd_config(num_blocks=12, init_new_token_ratio=ratio))
    core = side.core
    assert reserve(core, "a", 4, 16)
    start_remote(side, "a")  # 15 tokens to go: 4 blocks at ratio 1, ceil(7.5 / 4) = 2 at 0.5
    assert core.admission.blocks_kept_back() == (4 if ratio == 1.0 else 2)
    # 8 blocks of prompt + 8 tokens to go: 8 + 2 + 2 = 12 > 11 at ratio 1; 8 + 1 + 2 at 0.5.
    assert reserve(core, "b", 32, 8, seed=1) is accepted
    assert core.stats().num_free_blocks == (11 - 8 if accepted else 11)


def test_reservations_take_seats_and_a_full_house_refuses() -> None:
    side = Side(pd_config(max_num_seqs=2))
    core = side.core
    assert reserve(core, "a", 4, 4)
    assert reserve(core, "b", 4, 4, seed=1)
    start_remote(side, "b")  # a decode keeps its seat
    free = core.stats().num_free_blocks
    assert not reserve(core, "c", 4, 4, seed=2)
    stats = core.stats()
    assert stats.num_free_blocks == free and core.get_request("c") is None
    assert (stats.num_reservations_refused, stats.num_reserved) == (1, 1)
    core.abort("a")
    assert reserve(core, "c", 4, 4, seed=2)
    # Nothing is admitted past the seats the reservations hold.
    core.add_request("local", prompt_of(4, 9), greedy(3))
    side.truth["local"] = prompt_of(4, 9)
    output, _ = side.step()
    assert [s.request_id for s in output.seqs] == ["b"]
    assert status(core, "local") is S.WAITING


def run_decode_instance(
    config: SchedulerConfig, jobs: Sequence[tuple[str, int, int]], seed: int = 0
) -> tuple[Side, dict[str, list[int]], set[str]]:
    """A decode instance alone. Each tick every waiting job (id, prompt length,
    max_tokens) asks for a reservation, a refused one again the next tick; an
    accepted one's KV and first token arrive 0-2 ticks later; every request
    decodes to max_tokens. Returns the side, each job's output, and the jobs
    refused at least once. Fails on any preemption."""
    rng = random.Random(seed)
    side = Side(config)
    core = side.core
    waiting = list(jobs)
    arriving: list[tuple[int, str]] = []
    outputs: dict[str, list[int]] = {}
    refused: set[str] = set()
    tick = 0
    while waiting or arriving or core.has_unfinished_requests:
        assert tick < 10_000, f"no progress: {waiting}, {arriving}"
        still = []
        for job in waiting:
            rid, prompt_len, max_tokens = job
            if reserve(core, rid, prompt_len, max_tokens, seed=int(rid[1:])):
                arriving.append((tick + rng.randint(0, 2), rid))
            else:
                refused.add(rid)
                still.append(job)
        waiting = still
        for _, rid in [a for a in arriving if a[0] <= tick]:
            start_remote(side, rid)
            outputs[rid] = list(side.truth[rid][-1:])
        arriving = [a for a in arriving if a[0] > tick]
        _, updates = side.step()
        for update in updates:
            outputs[update.request_id].extend(update.new_token_ids)
        stats = core.stats()
        assert stats.num_preemptions_offload == stats.num_preemptions_recompute == 0
        tick += 1
    return side, outputs, refused


def check_decode_instance_run(
    config: SchedulerConfig, jobs: Sequence[tuple[str, int, int]], seed: int = 0
) -> set[str]:
    side, outputs, refused = run_decode_instance(config, jobs, seed)
    core = side.core
    for rid, prompt_len, max_tokens in jobs:
        want = expected(prompt_of(prompt_len, int(rid[1:])), greedy(max_tokens))
        assert outputs[rid] == want and len(want) == max_tokens, rid
    stats = core.stats()
    assert stats.num_reservations_accepted == stats.num_finished == len(jobs)
    assert stats.num_reservations_expired == 0
    assert pool_is_clean(core) and core.is_idle
    return refused


def test_full_reservations_never_preempt_and_refused_ones_complete_later() -> None:
    """Reserving every block a decode may need, a decode instance never has
    to preempt; the pressure shows only as refusals, which succeed later."""
    rng = random.Random(7)
    jobs = [(f"r{i}", rng.randint(3, 10), rng.randint(6, 20)) for i in range(16)]
    refused = check_decode_instance_run(pd_config(num_blocks=16), jobs)
    assert len(refused) >= 5  # the pool was under pressure


@settings(parent=settings.get_profile(PROFILE), max_examples=60)
@given(
    st.sampled_from([1, 2, 4, 8]),
    st.lists(st.tuples(st.integers(1, 12), st.integers(2, 24)), min_size=1, max_size=10),
    st.integers(0, 6),
    st.integers(1, 8),
    st.integers(0, 2**16),
)
def test_full_reservations_never_preempt_whatever_the_workload(
    block_size: int, shapes: list[tuple[int, int]], spare: int, max_num_seqs: int, seed: int
) -> None:
    def blocks(n: int) -> int:
        return -(-n // block_size)

    # The smallest pool one reservation fits in alone, plus a little.
    num_blocks = max(blocks(p) + blocks(m) for p, m in shapes) + spare
    config = pd_config(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=64)
    jobs = [(f"r{i}", p, m) for i, (p, m) in enumerate(shapes)]
    check_decode_instance_run(config, jobs, seed)


def test_an_unused_reservation_expires_at_schedule_and_its_blocks_return() -> None:
    clock = Clock(100.0)
    side = Side(pd_config(num_blocks=16, reservation_timeout_s=5.0), clock)
    core = side.core
    assert reserve(core, "a", 9, 4)  # 3 blocks, until 105
    clock.now = 102.0
    assert reserve(core, "b", 4, 4, seed=1)  # 1 block, until 107
    assert core.stats().num_free_blocks == 12
    clock.now = 104.999
    side.step()
    assert (status(core, "a"), status(core, "b")) == (S.RESERVED, S.RESERVED)
    clock.now = 105.0
    output, _ = side.step()
    assert output.seqs == [] and status(core, "a") is None and status(core, "b") is S.RESERVED
    stats = core.stats()
    # Expired, it is no request finished here (its prefill instance asks again).
    assert (stats.num_reserved, stats.num_reservations_expired, stats.num_finished) == (1, 1, 0)
    assert stats.num_free_blocks == 15
    with pytest.raises(NotFound, match="request a holds no reservation"):
        core.pd.start_remote_decode("a", "pre.a.0", 9, 5)
    with pytest.raises(NotFound):
        core.abort("a")
    core.check_integrity()
    # b is used in time: once decoding, it never expires.
    start_remote(side, "b")
    clock.now = 1000.0
    while core.has_unfinished_requests:
        side.step()
    assert side.truth["b"][4:] == expected(prompt_of(4, 1), greedy(4))
    stats = core.stats()
    assert (stats.num_reservations_expired, stats.num_finished) == (1, 1)
    assert stats.num_free_blocks + stats.num_evictable_blocks == 16 and core.is_idle
    assert reserve(core, "a", 9, 4)  # its id is free again, with a new deadline
    again = core.get_request("a")
    assert again is not None and again.reserved_until == 1005.0


def test_expiry_happens_at_schedule_not_before() -> None:
    """Past its deadline but before the next schedule(), a reservation is
    still there to be used."""
    clock = Clock(0.0)
    side = Side(pd_config(reservation_timeout_s=1.0), clock)
    assert reserve(side.core, "a", 4, 3)
    clock.now = 50.0
    start_remote(side, "a")
    side.step()
    assert status(side.core, "a") is S.RUNNING_DECODE
    assert side.core.stats().num_reservations_expired == 0


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(("prompt", "max_tokens", "message"), [
    ([1, 2, 3], 1, "request r: max_tokens 1 leaves nothing to decode after prefill"),
    ([], 4, "request r: prompt is empty"),
    ([1, VOCAB], 4, f"token id {VOCAB} at position 1 is outside the vocabulary"),
    ([1] * 250, 10, "exceeds max_model_len 256"),
    ([1] * 60, 10, "70 tokens need 18 blocks, the whole pool has 16"),
])
def test_reserve_refuses_bad_requests_changing_nothing(
    prompt: list[int], max_tokens: int, message: str
) -> None:
    core = Side(pd_config(num_blocks=16)).core
    with pytest.raises(InvalidArgument) as excinfo:
        core.pd.reserve("r", prompt, greedy(max_tokens))
    assert message in str(excinfo.value)
    stats = core.stats()
    assert core.get_request("r") is None and stats.num_free_blocks == 16
    assert (stats.num_reserved, stats.num_reservations_accepted,
            stats.num_reservations_refused) == (0, 0, 0)
    core.check_integrity()


def test_reserve_refuses_a_live_id_and_a_refused_id_stays_free() -> None:
    core = Side(pd_config(num_blocks=4, max_num_seqs=2)).core
    assert reserve(core, "a", 4, 4)
    with pytest.raises(AlreadyExists, match="request a already exists"):
        core.pd.reserve("a", [1], greedy(2))
    core.add_request("m", [1, 2], greedy(2))  # a local request's id is taken too
    with pytest.raises(AlreadyExists, match="request m already exists"):
        core.pd.reserve("m", [1], greedy(2))
    core.abort("m")  # a waiting request keeps reservations out (test_...waiting below)
    assert not reserve(core, "z", 8, 4)  # 2 + 1 + 1 kept back > 3
    assert core.get_request("z") is None
    core.abort("a")
    assert reserve(core, "z", 8, 4)
    core.check_integrity()


def test_start_remote_decode_checks_the_request_the_snapshot_and_the_first_token() -> None:
    core = Side(pd_config()).core
    assert core.pd.reserve("a", [5, 6, 7, 8, 9, 10], greedy(4, ignore_eos=False, stop=(7,)))
    core.add_request("m", [1, 2], greedy(2))
    before = core.stats()
    with pytest.raises(NotFound, match="request zz holds no reservation"):
        core.pd.start_remote_decode("zz", "pre.zz.0", 6, 3)
    with pytest.raises(NotFound, match="request m holds no reservation"):
        core.pd.start_remote_decode("m", "pre.m.0", 2, 3)
    for num_tokens in (5, 7):
        with pytest.raises(InvalidArgument,
                           match=f"the snapshot holds {num_tokens} tokens, its prompt has 6"):
            core.pd.start_remote_decode("a", "pre.a.0", num_tokens, 3)
    for first in (EOS, 7, -1, VOCAB):  # EOS, a stop token, outside the vocabulary
        with pytest.raises(InvalidArgument, match=f"first token {first} is outside"):
            core.pd.start_remote_decode("a", "pre.a.0", 6, first)
    req = core.get_request("a")
    assert req is not None and req.status is S.RESERVED and req.output_token_ids == []
    assert req.num_computed_tokens == 0 and req.snapshot is None and not core.life.copies
    assert core.stats() == before
    core.check_integrity()
    cmd = core.pd.start_remote_decode("a", "pre.a.0", 6, 3)
    assert (cmd.request_id, cmd.snapshot_id, cmd.block_ids) == ("a", "pre.a.0", req.block_ids)
    with pytest.raises(NotFound, match="request a holds no reservation"):  # used already
        core.pd.start_remote_decode("a", "pre.a.1", 6, 3)
    core.finish_restore(cmd, 128)
    with pytest.raises(NotFound):
        core.pd.start_remote_decode("a", "pre.a.1", 6, 3)
    core.check_integrity()


def test_a_snapshot_id_already_in_flight_is_refused() -> None:
    """FAILS (core bug): start_remote_decode keys the restore by the peer's
    snapshot id without checking that no copy of that id is in flight. A
    second request given the same id overwrites the first's entry in
    Lifecycle.copies: check_integrity fails ("1 live copies in flight, 2
    requests ... resuming"), the first restore to land resumes the wrong
    request, and the other stays RESUMING with its blocks forever."""
    core = Side(pd_config()).core
    assert core.pd.reserve("a", [1, 2, 3], greedy(4))
    assert core.pd.reserve("b", [4, 5, 6], greedy(4))
    core.pd.start_remote_decode("a", "pre.x.0", 3, 7)
    with pytest.raises(KvstashError):
        core.pd.start_remote_decode("b", "pre.x.0", 3, 7)
    core.check_integrity()
    assert status(core, "b") is S.RESERVED


def test_a_request_that_fits_the_pool_alone_is_reserved_on_an_idle_instance() -> None:
    core = Side(pd_config(num_blocks=2)).core  # blocks of 4 tokens
    prompt, sampling = [1] * 5, greedy(3)  # KV of at most 5 + 3 - 1 = 7 positions: 2 blocks
    core.check_request("a", prompt, sampling)
    assert core.pd.reserve("a", prompt, sampling)


def test_eos_may_come_first_when_the_request_ignores_it() -> None:
    core = Side(pd_config()).core
    assert core.pd.reserve("a", [5, 6, 7], greedy(3, ignore_eos=True))
    core.pd.start_remote_decode("a", "pre.a.0", 3, EOS)
    core.check_integrity()


# ------------------------------------------------------ decode side, copies


@pytest.mark.parametrize("committed", [True, False])
def test_a_remote_decode_whose_restore_fails_is_given_back(committed: bool) -> None:
    """committed: the restore lands and the request decodes here; else it
    is given back (aborted here, counted by its prefill instance), and
    its snapshot, its prefill instance's, is left to it: not deleted here,
    nothing recomputed here."""
    side = Side(pd_config())
    core = side.core
    prompt = prompt_of(6, 4)
    assert core.pd.reserve("a", prompt, greedy(5))
    cmd = start_remote(side, "a", land=False)
    if committed:
        side.worker.write(cmd.block_ids, 0, prompt)
    core.finish_restore(cmd, 128 if committed else None)
    core.check_integrity()
    assert status(core, "a") is (S.RUNNING_DECODE if committed else None)
    assert core.take_snapshots_to_delete() == []
    outputs = list(side.truth["a"][-1:])
    while core.has_unfinished_requests:
        _, updates = side.step()
        for update in updates:
            outputs.extend(update.new_token_ids)
    if committed:
        assert outputs == expected(prompt, greedy(5))
    stats = core.stats()
    assert (stats.num_restore_failures, stats.num_recomputed_tokens) == (
        (0, 0) if committed else (1, 0))
    assert stats.num_finished == (1 if committed else 0)
    assert stats.num_prompt_tokens == 0
    assert pool_is_clean(core) and core.is_idle


@pytest.mark.parametrize("committed", [True, False])
def test_abort_while_reserved_or_resuming_leaks_nothing(committed: bool) -> None:
    side = Side(pd_config(num_blocks=16))
    core = side.core
    assert reserve(core, "a", 8, 4)
    usage = core.abort("a")
    assert usage.num_output_tokens == 0
    core.check_integrity()
    assert core.stats().num_free_blocks == 16 and core.is_idle
    assert core.stats().num_reservations_expired == 0
    with pytest.raises(NotFound):
        core.pd.start_remote_decode("a", "pre.a.0", 8, 3)
    # Aborted while its KV is being copied in: the copy keeps the blocks until it lands.
    assert reserve(core, "b", 8, 4, seed=1)
    cmd = start_remote(side, "b", land=False)
    core.abort("b")
    core.check_integrity()
    assert core.stats().num_free_blocks == 14 and not core.is_idle
    # Its id is reserved and used anew meanwhile; the old copy must not touch it.
    assert reserve(core, "b", 4, 4, seed=2)
    new_cmd = start_remote(side, "b", land=False, snapshot_id="pre.b.1")
    assert not set(new_cmd.block_ids) & set(cmd.block_ids)
    core.finish_restore(cmd, 128 if committed else None)
    core.check_integrity()
    assert core.take_snapshots_to_delete() == []  # its prefill instance's to delete
    assert core.stats().num_free_blocks == 15 and status(core, "b") is S.RESUMING
    core.finish_restore(new_cmd, 128)
    assert status(core, "b") is S.RUNNING_DECODE
    core.abort("b")
    core.check_integrity()
    assert pool_is_clean(core) and core.is_idle


# ---------------------------------------------------------------- prefill side


def add_handoff(side: Side, request_id: str, prompt: list[int], sampling: SamplingParams,
                handoff: bool = True) -> None:
    side.core.add_request(request_id, prompt, sampling, handoff=handoff)
    side.truth[request_id] = list(prompt)
    side.core.check_integrity()


def handed_off(side: Side, request_id: str = "a", prompt_len: int = 6, max_tokens: int = 6,
               stop: Sequence[int] = ()) -> tuple[OffloadCommand, list[int | None]]:
    """A prefill core's request, prefilled and its handoff copy issued:
    the command and the KV it copies."""
    core = side.core
    prompt = prompt_of(prompt_len, 2)
    add_handoff(side, request_id, prompt, greedy(max_tokens, stop=stop))
    output, [update] = side.step()
    assert output.handoffs == [] and update.new_token_ids == [next_token(prompt, VOCAB)]
    assert status(core, request_id) is S.RUNNING_DECODE
    output, updates = side.step()
    [cmd] = output.handoffs
    assert output.seqs == [] and updates == []
    return cmd, side.worker.read(cmd.block_ids, cmd.num_tokens)


def test_a_prefilled_request_is_handed_off_at_the_next_schedule() -> None:
    side = Side(prefill_config(num_blocks=16))
    core = side.core
    prompt = prompt_of(6, 2)
    add_handoff(side, "a", prompt, greedy(6))
    side.step()
    req = core.get_request("a")
    assert req is not None and req.status is S.RUNNING_DECODE
    held = list(req.block_ids)
    output, updates = side.step()
    [cmd] = output.handoffs
    assert (cmd.request_id, cmd.num_tokens, cmd.block_ids) == ("a", 6, held[:2])
    assert output.seqs == [] and updates == [] and output.num_decodes == 0
    assert req.status is S.HANDING_OFF and req.snapshot_id == cmd.snapshot_id
    assert all(core.kv.pool.ref_cnt(b) == 1 for b in held)  # pinned by the copy
    assert side.worker.read(cmd.block_ids, 6) == prompt
    stats = core.stats()
    assert (stats.num_handed_off, stats.num_running_decode, stats.num_handoffs) == (1, 0, 0)
    output, _ = side.step()  # nothing to do meanwhile, and no second handoff
    assert output.handoffs == [] and output.seqs == []
    assert core.pd.finish_handoff(cmd, 512) is True
    core.check_integrity()
    assert req.status is S.HANDED_OFF and req.block_ids == [] and pool_is_clean(core)
    stats = core.stats()
    assert (stats.num_handed_off, stats.num_handoffs, stats.bytes_handed_off) == (1, 1, 512)
    assert stats.num_handoff_failures == 0 and stats.num_free_blocks == 16 - 1  # 1 cached
    output, _ = side.step()
    assert output.seqs == [] and output.handoffs == []
    assert not core.is_idle


@pytest.mark.parametrize("stopped", [True, False])
def test_remote_tokens_and_finish_remote_complete_a_handed_off_request(stopped: bool) -> None:
    side = Side(prefill_config())
    core = side.core
    cmd, _ = handed_off(side, max_tokens=6 if stopped else 5, stop=(STOP,))
    assert core.pd.finish_handoff(cmd, 512)
    first = side.truth["a"][-1]
    assert core.pd.remote_tokens("a", [31, 32]) == RequestUpdate("a", [31, 32])
    core.check_integrity()
    req = core.get_request("a")
    assert req is not None and req.output_token_ids == [first, 31, 32]
    assert req.status is S.HANDED_OFF and req.num_computed_tokens == 6
    remote = RequestUsage(6, 4, num_preemptions=2, num_recomputed_tokens=3,
                          bytes_offloaded=700, queue_time_s=None)
    last = STOP if stopped else 34
    update = core.pd.finish_remote("a", [33, last], stopped, remote)
    core.check_integrity()
    assert update is not None and update.new_token_ids == [33, last]
    assert update.finish_status is (S.FINISHED_STOPPED if stopped else S.FINISHED_LENGTH)
    assert update.usage == RequestUsage(6, 5, 2, 3, 700, 0.0)
    stats = core.stats()
    # Its end and the decode instance's tokens count there, not here (one
    # request, five tokens over the pair): only the first token was sampled here.
    assert (stats.num_finished, stats.num_handed_off, stats.num_generation_tokens) == (0, 0, 1)
    assert stats.num_prompt_tokens == 6
    assert core.get_request("a") is None
    assert core.take_snapshots_to_delete() == []  # the decode instance read it
    assert core.is_idle and pool_is_clean(core)
    # Finished: nothing more arrives for it.
    assert core.pd.remote_tokens("a", [1]) is None
    assert core.pd.finish_remote("a", [1], True, remote) is None
    core.pd.take_back("a")
    core.check_integrity()


def test_a_stop_token_at_the_last_allowed_position_is_a_length_end() -> None:
    """As vLLM and SGLang report it (they look at the length first): the
    decode instance says length, and a stop end there is refused."""
    side = Side(prefill_config())
    cmd, _ = handed_off(side, max_tokens=3, stop=(STOP,))
    assert side.core.pd.finish_handoff(cmd, 512)
    remote = RequestUsage(6, 3, 0, 0, 0, queue_time_s=None)
    with pytest.raises(InvalidArgument, match="a remote stop finish"):
        side.core.pd.finish_remote("a", [31, STOP], True, remote)
    update = side.core.pd.finish_remote("a", [31, STOP], False, remote)
    assert update is not None and update.finish_status is S.FINISHED_LENGTH


def _handed_to_a_decode_instance() -> tuple[Side, Side]:
    """A request "a" handed off by one core and decoding on another."""
    prefill, decode = Side(prefill_config()), Side(pd_config())
    cmd, _ = handed_off(prefill, max_tokens=6)
    assert prefill.core.pd.finish_handoff(cmd, 512)
    assert reserve(decode.core, "a", 6, 6, seed=2)
    start_remote(decode, "a")
    return prefill, decode


def test_a_handed_off_request_that_ends_early_counts_once_over_the_pair() -> None:
    """Aborted by its client (the prefill instance aborts it, and its relay's
    end aborts it on the decode instance), or taken back after tokens came
    (aborted there, finished here): it counts as finished once, on the
    prefill instance, whose client call ended."""
    prefill, decode = _handed_to_a_decode_instance()
    prefill.core.abort("a")
    decode.core.abort("a")
    assert (prefill.core.stats().num_finished, decode.core.stats().num_finished) == (1, 0)

    prefill, decode = _handed_to_a_decode_instance()
    _, [update] = decode.step(decode.land_restores)  # one token sampled there, relayed
    prefill.core.pd.remote_tokens("a", update.new_token_ids)
    prefill.truth["a"].extend(update.new_token_ids)
    decode.core.abort("a")
    prefill.core.pd.take_back("a")
    prefill.run_to_end()
    assert (prefill.core.stats().num_finished, decode.core.stats().num_finished) == (1, 0)


@pytest.mark.parametrize("sampling", [greedy(1), "stop"], ids=["max_tokens_1", "stop_token"])
def test_a_request_whose_first_token_ends_it_is_never_handed_off(
    sampling: SamplingParams | str
) -> None:
    side = Side(prefill_config())
    core = side.core
    prompt = prompt_of(6, 3)
    if sampling == "stop":
        sampling = greedy(8, stop=(next_token(prompt, VOCAB),))
    assert isinstance(sampling, SamplingParams)
    add_handoff(side, "a", prompt, sampling)
    _, [update] = side.step()
    assert update.finish_status in (S.FINISHED_STOPPED, S.FINISHED_LENGTH)
    output, _ = side.step()
    assert output.handoffs == []
    stats = core.stats()
    assert (stats.num_handoffs, stats.num_handed_off, stats.num_finished) == (0, 0, 1)
    assert pool_is_clean(core) and core.is_idle


def test_a_request_aborted_before_its_handoff_is_not_handed_off() -> None:
    side = Side(prefill_config())
    core = side.core
    add_handoff(side, "a", prompt_of(6), greedy(5))
    side.step()
    core.abort("a")
    add_handoff(side, "a", prompt_of(5, 1), greedy(5), handoff=False)  # the id anew
    output, _ = side.step()
    assert output.handoffs == [] and status(core, "a") is S.RUNNING_DECODE
    assert core.stats().num_handed_off == 0


def test_a_handoff_frees_its_seat_at_once() -> None:
    side = Side(prefill_config(max_num_seqs=1))
    core = side.core
    add_handoff(side, "a", prompt_of(6), greedy(5))
    add_handoff(side, "b", prompt_of(5, 1), greedy(5), handoff=False)
    output, _ = side.step()
    assert [s.request_id for s in output.seqs] == ["a"]
    output, _ = side.step()
    assert [c.request_id for c in output.handoffs] == ["a"]
    assert [s.request_id for s in output.seqs] == ["b"]  # admitted in the same step
    assert (status(core, "a"), status(core, "b")) == (S.HANDING_OFF, S.RUNNING_DECODE)


def test_a_failed_handoff_whose_seat_was_taken_waits_for_one_and_keeps_its_tokens() -> None:
    """Its seat went to "b" when its copy began: the copy failed, "a" is
    recomputed once a seat is free, as after a recompute preemption."""
    side = Side(prefill_config(max_num_seqs=1))
    core = side.core
    add_handoff(side, "a", prompt_of(6), greedy(5))
    add_handoff(side, "b", prompt_of(5, 1), greedy(5), handoff=False)
    side.step()
    output, _ = side.step()
    [cmd] = output.handoffs
    assert status(core, "b") is S.RUNNING_DECODE
    assert core.pd.finish_handoff(cmd, None) is False
    core.check_integrity()
    req = core.get_request("a")
    assert req is not None and req.status is S.WAITING and req.block_ids == []
    side.run_to_end()  # integrity checked at every step: one request runs at a time
    assert side.truth["a"][6:] == expected(prompt_of(6), greedy(5))
    assert core.stats().num_handoff_failures == 1 and pool_is_clean(core)


def test_a_chunked_prefill_is_handed_off_after_its_last_chunk() -> None:
    side = Side(prefill_config(max_num_batched_tokens=16))
    core = side.core
    add_handoff(side, "a", prompt_of(40), greedy(5))
    for _ in range(3):  # chunks of 16, 16, 8
        output, _ = side.step()
        assert output.handoffs == [] and status(core, "a") in (S.RUNNING_PREFILL,
                                                                S.RUNNING_DECODE)
    assert status(core, "a") is S.RUNNING_DECODE
    output, _ = side.step()
    [cmd] = output.handoffs
    assert cmd.num_tokens == 40 and len(cmd.block_ids) == 10


def test_a_failed_handoff_copy_decodes_here_with_the_same_tokens() -> None:
    side = Side(prefill_config())
    core = side.core
    cmd, _ = handed_off(side)
    req = core.get_request("a")
    assert req is not None
    held = list(req.block_ids)
    assert core.pd.finish_handoff(cmd, None) is False
    core.check_integrity()
    assert req.status is S.RUNNING_DECODE and req.block_ids == held
    assert not core.pd.will_hand_off("a")
    assert req.snapshot is None and core.take_snapshots_to_delete() == []
    stats = core.stats()
    assert (stats.num_handoff_failures, stats.num_handoffs, stats.num_handed_off) == (1, 0, 0)
    side.run_to_end()
    assert side.truth["a"][6:] == expected(prompt_of(6, 2), greedy(6))
    assert core.stats().num_recomputed_tokens == 0 and pool_is_clean(core)


@pytest.mark.parametrize("snapshot_kept", [True, False])
def test_taken_back_before_any_remote_token_resumes_from_the_snapshot(
    snapshot_kept: bool
) -> None:
    """snapshot_kept: the decode instance never read it; else it consumed
    it, the restore fails and the request is recomputed. Same tokens."""
    side = Side(prefill_config())
    core = side.core
    cmd, kv = handed_off(side)
    assert core.pd.finish_handoff(cmd, 512)
    if snapshot_kept:
        side.cache[cmd.snapshot_id] = kv
    core.pd.take_back("a")
    core.check_integrity()
    req = core.get_request("a")
    assert req is not None and req.status is S.OFFLOADED and req.snapshot_id == cmd.snapshot_id
    assert not core.pd.will_hand_off("a") and core.take_snapshots_to_delete() == []
    stats = core.stats()
    assert (stats.num_handoff_failures, stats.num_offloaded, stats.num_handed_off) == (1, 1, 0)
    output, _ = side.step(side.land_restores)
    [restore] = output.restores
    assert (restore.request_id, restore.snapshot_id, len(restore.block_ids)) == (
        "a", cmd.snapshot_id, 2)
    side.run_to_end()
    assert side.truth["a"][6:] == expected(prompt_of(6, 2), greedy(6))
    stats = core.stats()
    assert stats.num_restore_failures == (0 if snapshot_kept else 1)
    # Recomputed: the prompt past its cached full block (positions 4 and 5).
    assert stats.num_recomputed_tokens == (0 if snapshot_kept else 2)
    assert core.take_snapshots_to_delete() == ([] if snapshot_kept else [cmd.snapshot_id])
    assert pool_is_clean(core) and core.is_idle


def test_taken_back_after_remote_tokens_is_recomputed_with_the_same_tokens() -> None:
    side = Side(prefill_config())
    core = side.core
    cmd, _ = handed_off(side)
    assert core.pd.finish_handoff(cmd, 512)
    want = expected(prompt_of(6, 2), greedy(6))
    core.pd.remote_tokens("a", want[1:3])
    side.truth["a"].extend(want[1:3])
    core.pd.take_back("a")
    core.check_integrity()
    req = core.get_request("a")
    assert req is not None and req.status is S.WAITING and req.snapshot is None
    assert req.output_token_ids == want[:3] and req.num_computed_tokens == 0
    assert core.take_snapshots_to_delete() == [cmd.snapshot_id]
    assert core.stats().num_handoff_failures == 1
    output, updates = side.step()
    [seq] = output.seqs
    # The prompt's full block is still cached here: a prefix hit.
    assert (seq.start_pos, seq.token_ids) == (4, [*prompt_of(6, 2)[4:], *want[:3]])
    assert updates[0].new_token_ids == [want[3]]
    side.run_to_end()
    assert side.truth["a"][6:] == want
    # Recomputed: the positions that had KV here (the prompt) past the prefix hit.
    assert core.stats().num_recomputed_tokens == 2
    assert pool_is_clean(core) and core.is_idle


def test_a_handoff_copy_lands_once_and_only_as_a_handoff() -> None:
    side = Side(prefill_config())
    core = side.core
    cmd, _ = handed_off(side)
    with pytest.raises(FailedPrecondition, match="no copy of snapshot"):
        core.finish_offload(cmd, 10)
    with pytest.raises(FailedPrecondition, match="no copy of snapshot"):
        core.finish_restore(RestoreCommand("a", cmd.snapshot_id, cmd.block_ids), 10)
    core.check_integrity()
    assert status(core, "a") is S.HANDING_OFF
    assert core.pd.finish_handoff(cmd, 10)
    with pytest.raises(FailedPrecondition, match="no copy of snapshot"):
        core.pd.finish_handoff(cmd, 10)
    core.check_integrity()
    assert core.stats().num_handoffs == 1


def test_remote_calls_for_a_request_not_handed_off_change_nothing() -> None:
    side = Side(prefill_config())
    core = side.core
    usage = RequestUsage(6, 2, 0, 0, 0, None)
    assert core.pd.remote_tokens("zz", [1]) is None
    assert core.pd.finish_remote("zz", [1], True, usage) is None
    core.pd.take_back("zz")
    handed_off(side)  # "a" is HANDING_OFF
    add_handoff(side, "local", prompt_of(4, 5), greedy(4), handoff=False)
    side.step()  # "local" decoding
    for rid in ("a", "local"):
        req = core.get_request(rid)
        assert req is not None
        before = (req.status, list(req.output_token_ids))
        assert core.pd.remote_tokens(rid, [1]) is None
        assert core.pd.finish_remote(rid, [1], True, usage) is None
        core.pd.take_back(rid)
        assert (req.status, req.output_token_ids) == before
        core.check_integrity()
    assert core.stats().num_handoff_failures == 0


@pytest.mark.parametrize("committed", [True, False])
def test_abort_while_handing_off_lets_the_copy_free_the_blocks(committed: bool) -> None:
    side = Side(prefill_config(num_blocks=16))
    core = side.core
    cmd, _ = handed_off(side)
    core.abort("a")
    core.check_integrity()
    assert core.get_request("a") is None and core.stats().num_handed_off == 0
    assert all(core.kv.pool.ref_cnt(b) == 1 for b in cmd.block_ids) and not core.is_idle
    # The id is reused meanwhile; the old copy must not touch the new request.
    add_handoff(side, "a", prompt_of(5, 8), greedy(4))
    side.step()
    output, _ = side.step()
    [new_cmd] = output.handoffs
    assert new_cmd.snapshot_id != cmd.snapshot_id
    assert core.pd.finish_handoff(cmd, 512 if committed else None) is False
    core.check_integrity()
    assert status(core, "a") is S.HANDING_OFF
    assert core.take_snapshots_to_delete() == ([cmd.snapshot_id] if committed else [])
    stats = core.stats()
    assert (stats.num_handoffs, stats.num_handoff_failures, stats.bytes_handed_off) == (0, 0, 0)
    assert core.pd.finish_handoff(new_cmd, 256)
    core.abort("a")
    core.check_integrity()
    assert core.take_snapshots_to_delete() == [new_cmd.snapshot_id]
    assert pool_is_clean(core) and core.is_idle


def test_abort_when_handed_off_deletes_the_snapshot() -> None:
    side = Side(prefill_config())
    core = side.core
    cmd, _ = handed_off(side)
    assert core.pd.finish_handoff(cmd, 512)
    core.pd.remote_tokens("a", [4])
    usage = core.abort("a")
    core.check_integrity()
    assert usage.num_output_tokens == 2
    assert core.take_snapshots_to_delete() == [cmd.snapshot_id]
    assert core.pd.remote_tokens("a", [5]) is None
    assert core.pd.finish_remote("a", [5], True, RequestUsage(6, 3, 0, 0, 0, None)) is None
    core.pd.take_back("a")
    core.check_integrity()
    assert core.stats().num_handed_off == 0 and pool_is_clean(core) and core.is_idle


# ------------------------------------------------------------- both, in memory


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    tick: int = 0  # arrives at this tick


@dataclass
class _Copy:
    due: int
    side: Side
    kind: str  # "offload", "restore" or "handoff"
    cmd: OffloadCommand | RestoreCommand


class PD:
    """A prefill core and a decode core wired as their engines wire them.

    A job asks the decode core for a reservation (again every tick while
    refused), then enters the prefill core with handoff=True; a job with
    max_tokens 1 enters it at once, with no reservation. `mixed`: one core
    serves everything (the reference). Copies land 0..max_delay ticks
    after they start. Failures: `fail_handoffs` (request ids),
    `fail_restores` (request ids whose restore on the decode core fails,
    their snapshot left in the cache), `lose`
    (request id -> "before_restore", "after_restore" or a number of remote
    tokens: the decode instance is lost then), `aborts` (tick -> ids)."""

    def __init__(
        self, prefill: SchedulerConfig, decode: SchedulerConfig | None = None, *,
        mixed: bool = False, seed: int = 0, max_delay: int = 0,
    ) -> None:
        self.clock = Clock()
        self.prefill = Side(replace(prefill, role=Role.MIXED if mixed else Role.PREFILL),
                            self.clock)
        self.decode = Side(replace(decode or prefill, role=Role.DECODE), self.clock)
        self.mixed = mixed
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        # The cache service: snapshot id -> the tokens whose KV it holds.
        self.cache: dict[str, list[int | None]] = {}
        self.copies: list[_Copy] = []
        self.tick = 0
        self.jobs: list[Job] = []
        self.pending: list[Job] = []
        # Reserved on, or decoding on, the decode core.
        self.on_decode: set[str] = set()
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, RequestStatus] = {}
        self.usages: dict[str, RequestUsage] = {}
        self.num_refusals = 0
        self.num_handoffs = 0
        self.fail_handoffs: set[str] = set()
        self.fail_restores: set[str] = set()
        self.lose: dict[str, str | int] = {}
        self.aborts: dict[int, list[str]] = {}
        self.lost: set[str] = set()
        # Tokens the decode core sampled and the prefill core relayed, and the
        # requests that finished there: each counts on the decode core only.
        self.relayed_tokens = 0
        self.finished_there: set[str] = set()
        # What each abort found: (prefill core's status, decode core's status).
        self.aborted_in: list[tuple[RequestStatus | None, RequestStatus | None]] = []

    # -- the loop

    def run(self, jobs: Sequence[Job], max_ticks: int = 5000) -> dict[str, list[int]]:
        self.jobs = list(jobs)
        self.outputs = {job.request_id: [] for job in jobs}
        last = max([j.tick for j in jobs] + list(self.aborts) + [0])
        while (self.tick <= last or len(self.finished) < len(jobs) or self.copies
               or not (self.prefill.core.is_idle and self.decode.core.is_idle)):
            assert self.tick < max_ticks, f"no progress: {sorted(self.finished)}"
            self.step()
        self._check_end()
        return self.outputs

    def step(self) -> None:
        self.pending += [job for job in self.jobs if job.tick == self.tick]
        for request_id in self.aborts.get(self.tick, []):
            self.abort(request_id)
        self._reserve_pending()
        _, updates = self.prefill.step(lambda out: self._start_copies(self.prefill, out))
        for update in updates:
            self._deliver(update)
        _, updates = self.decode.step(lambda out: self._start_copies(self.decode, out))
        for update in updates:
            self._relay(update)
        due = [c for c in self.copies if c.due <= self.tick]
        self.copies = [c for c in self.copies if c.due > self.tick]
        for copy in due:
            self._land(copy)
        self._lose_after_tokens()
        for side in (self.prefill, self.decode):
            for snapshot_id in side.core.take_snapshots_to_delete():
                self.cache.pop(snapshot_id, None)
        self.clock.now += 0.01
        self.tick += 1

    def _reserve_pending(self) -> None:
        still = []
        prefill, decode = self.prefill.core, self.decode.core
        for job in self.pending:
            rid = job.request_id
            remote = not self.mixed and job.sampling.max_tokens >= 2
            if remote:
                if not decode.pd.reserve(rid, job.prompt, job.sampling):
                    self.num_refusals += 1
                    still.append(job)
                    continue
                decode.check_integrity()
                self.on_decode.add(rid)
            prefill.add_request(rid, job.prompt, job.sampling, handoff=not self.mixed)
            prefill.check_integrity()
            self.prefill.truth[rid] = list(job.prompt)
        self.pending = still

    def abort(self, request_id: str) -> None:
        job = next(j for j in self.jobs if j.request_id == request_id)
        self.aborted_in.append((status(self.prefill.core, request_id),
                                status(self.decode.core, request_id)))
        if job in self.pending:
            self.pending.remove(job)
        elif self.prefill.core.get_request(request_id) is not None:
            self.prefill.core.abort(request_id)
            self.prefill.core.check_integrity()
            self._release(request_id)
        else:
            return  # finished already, or not arrived
        self.finished[request_id] = S.FINISHED_ABORTED

    # -- tokens

    def _deliver(self, update: RequestUpdate) -> None:
        """The prefill core's update, to the client."""
        rid = update.request_id
        assert rid not in self.finished
        self.outputs[rid].extend(update.new_token_ids)
        if update.finish_status is not None:
            assert update.usage is not None
            self.finished[rid] = update.finish_status
            self.usages[rid] = update.usage
            self._release(rid)  # its first token ended it: the reservation goes unused

    def _relay(self, update: RequestUpdate) -> None:
        """The decode core's update, to the prefill core (as Engine._relay)."""
        rid = update.request_id
        assert rid in self.on_decode
        prefill = self.prefill.core
        if update.finish_status is None:
            answer = prefill.pd.remote_tokens(rid, update.new_token_ids)
        else:
            self.on_decode.discard(rid)
            assert update.usage is not None
            answer = prefill.pd.finish_remote(rid, update.new_token_ids,
                                              update.finish_status is S.FINISHED_STOPPED,
                                              update.usage)
            assert answer is not None and answer.finish_status is update.finish_status
            self.finished_there.add(rid)
        prefill.check_integrity()
        assert answer is not None and answer.new_token_ids == update.new_token_ids
        self.relayed_tokens += len(answer.new_token_ids)
        self.prefill.truth[rid].extend(answer.new_token_ids)
        self._deliver(answer)

    def _release(self, request_id: str) -> None:
        """The decode core forgets the request (released, or the instance is lost)."""
        if request_id in self.on_decode:
            self.on_decode.discard(request_id)
            if self.decode.core.get_request(request_id) is not None:  # else expired there
                self.decode.core.abort(request_id)
                self.decode.core.check_integrity()

    # -- copies

    def _start_copies(self, side: Side, output: SchedulerOutput) -> None:
        for cmd in output.handoffs:
            assert cmd.request_id in self.on_decode, f"{cmd.request_id} handed off unreserved"
            self.num_handoffs += 1
            self._start(side, "handoff", cmd)
        for offload in output.offloads:
            self._start(side, "offload", offload)
        for restore in output.restores:
            self._start(side, "restore", restore)

    def _start(self, side: Side, kind: str, cmd: OffloadCommand | RestoreCommand) -> None:
        if isinstance(cmd, RestoreCommand):
            busy = set(side.reading).intersection(cmd.block_ids) | side.writing.intersection(
                cmd.block_ids)
            assert not busy, f"restoring into blocks {busy} under another copy"
            side.writing.update(cmd.block_ids)
        else:
            side.reading.update(cmd.block_ids)
        self.copies.append(_Copy(self.tick + self.rng.randint(0, self.max_delay), side, kind, cmd))

    def _land(self, copy: _Copy) -> None:
        side, cmd = copy.side, copy.cmd
        core = side.core
        rid = cmd.request_id
        if isinstance(cmd, RestoreCommand):
            side.writing.difference_update(cmd.block_ids)
            # A restore consumes the snapshot; one that fails there leaves it.
            kv = None if side is self.decode and rid in self.fail_restores else (
                self.cache.pop(cmd.snapshot_id, None))
            if kv is not None:
                assert None not in kv
                side.worker.write(cmd.block_ids, 0, [t for t in kv if t is not None])
            core.finish_restore(cmd, None if kv is None else len(cmd.block_ids) * BYTES_PER_BLOCK)
            core.check_integrity()
            if side is self.decode and (self.lose.get(rid) == "after_restore"
                                        or core.get_request(rid) is None):  # or given back
                self._lose(rid)
            return
        side.reading.subtract(cmd.block_ids)
        side.reading = +side.reading
        num_bytes = None
        if not (copy.kind == "handoff" and rid in self.fail_handoffs):
            kv = side.worker.read(cmd.block_ids, cmd.num_tokens)
            assert kv == side.truth[rid][: cmd.num_tokens], f"snapshot of {rid} is corrupt"
            assert cmd.snapshot_id not in self.cache
            self.cache[cmd.snapshot_id] = kv
            num_bytes = len(cmd.block_ids) * BYTES_PER_BLOCK
        if copy.kind == "offload":
            core.finish_offload(cmd, num_bytes)
            core.check_integrity()
            return
        handed = core.pd.finish_handoff(cmd, num_bytes)
        core.check_integrity()
        if not handed:
            self._release(rid)  # it decodes here, or it was aborted
            return
        req = core.get_request(rid)
        assert req is not None and req.status is S.HANDED_OFF and not req.block_ids
        assert cmd.num_tokens == req.num_prompt_tokens
        if self.lose.get(rid) == "before_restore":
            self._lose(rid)
            return
        first = req.output_token_ids[-1]
        try:
            restore = self.decode.core.pd.start_remote_decode(rid, cmd.snapshot_id,
                                                              cmd.num_tokens, first)
        except NotFound:  # the reservation expired: as a lost decode instance
            assert status(self.decode.core, rid) is None
            self._lose(rid)
            return
        self.decode.core.check_integrity()
        self.decode.truth[rid] = [*req.prompt_token_ids, first]
        self._start(self.decode, "restore", restore)

    # -- losses

    def _lose_after_tokens(self) -> None:
        for rid, when in self.lose.items():
            if (isinstance(when, int) and status(self.prefill.core, rid) is S.HANDED_OFF
                    and len(self.outputs[rid]) - 1 >= when):
                self._lose(rid)

    def _lose(self, request_id: str) -> None:
        if status(self.prefill.core, request_id) is not S.HANDED_OFF:
            return
        self._release(request_id)
        self.prefill.core.pd.take_back(request_id)
        self.prefill.core.check_integrity()
        self.lost.add(request_id)

    # -- the end

    def _check_end(self) -> None:
        for side in (self.prefill, self.decode):
            core = side.core
            assert pool_is_clean(core), "blocks leak"
            assert core.is_idle and core.take_snapshots_to_delete() == []
            assert not side.reading and not side.writing
        assert not self.cache, f"snapshots leak: {sorted(self.cache)}"
        assert not self.on_decode and not self.pending
        prefill = self.prefill.core.stats()
        assert prefill.num_finished == len(self.outputs) - len(self.finished_there) - sum(
            1 for rid, out in self.outputs.items()
            if self.finished[rid] is S.FINISHED_ABORTED and rid not in self.prefill.truth)
        assert prefill.num_generation_tokens == sum(
            len(o) for o in self.outputs.values()) - self.relayed_tokens
        decode = self.decode.core.stats()
        if not self.mixed:  # only what finished there: the rest counts here
            assert decode.num_finished == len(self.finished_there)
        for job in self.jobs:
            rid = job.request_id
            want = expected(job.prompt, job.sampling)
            got = self.outputs[rid]
            if self.finished[rid] is S.FINISHED_ABORTED:
                assert got == want[: len(got)], f"{rid}: {got} is no prefix of {want}"
                continue
            assert got == want, f"{rid}: generated {got}, alone it generates {want}"
            usage = self.usages[rid]
            assert (usage.num_prompt_tokens, usage.num_output_tokens) == (len(job.prompt),
                                                                         len(got))


def make_jobs(num: int, seed: int, max_tick: int = 6) -> list[Job]:
    """Varied jobs: EOS may end them (ignore_eos off for some), one with
    max_tokens 1 and one whose first token is a stop token."""
    rng = random.Random(seed)
    jobs = []
    for i in range(num):
        prompt = tuple(rng.randint(1, VOCAB - 1) for _ in range(rng.randint(1, 14)))
        max_tokens = rng.randint(2, 20)
        stop: tuple[int, ...] = ()
        if i == 1:
            max_tokens = 1
        elif i == 2:
            stop = (next_token(prompt, VOCAB),)
        sampling = greedy(max_tokens, ignore_eos=rng.random() < 0.7, stop=stop)
        jobs.append(Job(f"j{i}", prompt, sampling, rng.randint(0, max_tick)))
    return jobs


def mixed_outputs(jobs: Sequence[Job], seed: int = 0) -> dict[str, list[int]]:
    """The same jobs on one mixed core."""
    return PD(make_config(num_blocks=64), mixed=True, seed=seed, max_delay=2).run(jobs)


DECODE_CONFIGS = {
    # Full reservations on a small pool: refusals, never a preemption.
    "full": pd_config(num_blocks=14, max_num_seqs=6),
    # A low ratio, decaying fast, on a small pool: preemptions, by offload or recompute.
    "offload": make_config(num_blocks=14, max_num_seqs=6, preemption_mode=PreemptionMode.OFFLOAD,
                           init_new_token_ratio=0.2, new_token_ratio_decay_steps=5),
    "recompute": make_config(num_blocks=14, max_num_seqs=6,
                             preemption_mode=PreemptionMode.RECOMPUTE,
                             init_new_token_ratio=0.2, new_token_ratio_decay_steps=5),
}


@pytest.mark.parametrize("max_delay", [0, 2])
@pytest.mark.parametrize("decode", sorted(DECODE_CONFIGS))
def test_pd_generates_the_tokens_one_mixed_core_generates(decode: str, max_delay: int) -> None:
    jobs = make_jobs(14, seed=3)
    pd = PD(make_config(num_blocks=32), DECODE_CONFIGS[decode], seed=5, max_delay=max_delay)
    outputs = pd.run(jobs)
    assert outputs == mixed_outputs(jobs)
    assert pd.num_refusals > 0  # the decode side was under pressure
    prefill, decode_stats = pd.prefill.core.stats(), pd.decode.core.stats()
    num_remote = sum(1 for j in jobs if j.sampling.max_tokens >= 2)
    # All but the job whose first token stops it were handed off, and decoded there.
    assert pd.num_handoffs == prefill.num_handoffs == num_remote - 1
    assert prefill.num_handoff_failures == 0
    assert decode_stats.num_reservations_accepted == num_remote
    assert decode_stats.num_reservations_refused == pd.num_refusals
    num_preemptions = decode_stats.num_preemptions_offload + decode_stats.num_preemptions_recompute
    if decode == "full":
        assert num_preemptions == 0
    # Preemptions on the decode side show in the usage the prefill side reports.
    assert sum(u.num_preemptions for u in pd.usages.values()) == num_preemptions


def test_pd_preemptions_on_the_decode_side_happen_in_the_pressured_configs() -> None:
    """The 'offload' and 'recompute' decode configs really do preempt (else
    the test above would not cover remote decodes under preemption)."""
    for name in ("offload", "recompute"):
        pd = PD(make_config(num_blocks=32), DECODE_CONFIGS[name], seed=5)
        pd.run(make_jobs(14, seed=3))
        stats = pd.decode.core.stats()
        assert stats.num_preemptions_offload + stats.num_preemptions_recompute > 0, name
        # Hand-offs restored count apart from its own preempted requests' restores.
        assert stats.bytes_handed_in == pd.prefill.core.stats().bytes_handed_off > 0
        assert stats.bytes_restored == stats.bytes_offloaded, name
        assert (stats.bytes_offloaded > 0) == (name == "offload")


LOSSES: dict[str, str | int] = {"before_restore": "before_restore",
                                "after_restore": "after_restore", "after_1": 1, "after_3": 3}


@pytest.mark.parametrize("max_delay", [0, 2])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_lost_decode_instance_is_finished_on_the_prefill_side(loss: str, max_delay: int) -> None:
    jobs = [Job(f"j{i}", tuple(prompt_of(5 + i, i)), greedy(12)) for i in range(4)]
    pd = PD(make_config(num_blocks=32), pd_config(num_blocks=32), seed=1, max_delay=max_delay)
    pd.lose = {"j0": LOSSES[loss], "j2": LOSSES[loss]}
    outputs = pd.run(jobs)
    assert outputs == mixed_outputs(jobs)
    assert pd.lost == {"j0", "j2"}
    stats = pd.prefill.core.stats()
    assert stats.num_handoff_failures == 2 and stats.num_handoffs == 4
    recomputes = loss in ("after_restore", "after_1", "after_3")
    # Recomputed: the prompt, which had KV here, past its cached full blocks
    # (prompts of 5 and 7 tokens in blocks of 4: 1 and 3 tokens).
    assert stats.num_recomputed_tokens == (4 if recomputes else 0)
    assert pd.usages["j0"].num_recomputed_tokens == (1 if recomputes else 0)
    assert stats.num_restore_failures == (2 if loss == "after_restore" else 0)


@pytest.mark.parametrize("max_delay", [0, 2])
def test_a_failed_restore_there_is_decoded_here_from_the_snapshot(max_delay: int) -> None:
    """The decode core's restores of j0 and j2 fail: it gives them back,
    their snapshots left in the cache, and the prefill core takes them back
    and resumes them from those snapshots: nothing recomputed anywhere."""
    jobs = [Job(f"j{i}", tuple(prompt_of(5 + i, i)), greedy(12)) for i in range(4)]
    pd = PD(make_config(num_blocks=32), pd_config(num_blocks=32), seed=1, max_delay=max_delay)
    pd.fail_restores = {"j0", "j2"}
    assert pd.run(jobs) == mixed_outputs(jobs)
    assert pd.lost == {"j0", "j2"}
    prefill, decode = pd.prefill.core.stats(), pd.decode.core.stats()
    assert (prefill.num_handoff_failures, prefill.num_restore_failures) == (2, 0)
    assert prefill.num_recomputed_tokens == decode.num_recomputed_tokens == 0
    assert (decode.num_restore_failures, decode.num_finished) == (2, 2)


def test_reservations_expired_before_their_handoff_finish_on_the_prefill_side() -> None:
    """Long prompts, prefilled in chunks, outlive their reservations (3 ticks):
    the decode core refuses their snapshots, the prefill core takes them back."""
    jobs = [Job(f"j{i}", tuple(prompt_of(30 + i, i)), greedy(8)) for i in range(3)]
    pd = PD(make_config(num_blocks=64, max_num_batched_tokens=8),
            pd_config(num_blocks=32, reservation_timeout_s=0.03), seed=2)
    assert pd.run(jobs) == mixed_outputs(jobs)
    decode = pd.decode.core.stats()
    assert decode.num_reservations_expired == 3 and pd.lost == {"j0", "j1", "j2"}
    stats = pd.prefill.core.stats()
    assert (stats.num_handoffs, stats.num_handoff_failures, stats.num_restore_failures) == (
        3, 3, 0)


def test_a_failed_handoff_decodes_on_the_prefill_side_with_the_same_tokens() -> None:
    jobs = [Job(f"j{i}", tuple(prompt_of(5 + i, i)), greedy(10)) for i in range(4)]
    pd = PD(make_config(num_blocks=32), pd_config(num_blocks=32), seed=1, max_delay=1)
    pd.fail_handoffs = {"j1", "j3"}
    assert pd.run(jobs) == mixed_outputs(jobs)
    stats = pd.prefill.core.stats()
    assert (stats.num_handoffs, stats.num_handoff_failures) == (2, 2)
    decode = pd.decode.core.stats()
    # The two whose copies failed let their reservations go there and finished
    # here: each counted once, where it ended.
    assert (decode.num_reservations_accepted, decode.num_finished) == (4, 2)
    assert stats.num_finished == 2


def test_aborts_at_any_point_leak_nothing_on_either_side() -> None:
    """j0 is aborted at every tick of its life, copies landing at once or
    later: waiting for its reservation, RESERVED there and prefilling here,
    HANDING_OFF, HANDED_OFF while the decode core restores or decodes it."""
    found = set()
    for max_delay in (0, 3):
        for tick in range(10):
            jobs = [Job("j0", tuple(prompt_of(9)), greedy(10)),
                    Job("j1", tuple(prompt_of(6, 1)), greedy(8))]
            pd = PD(make_config(num_blocks=32, max_num_batched_tokens=8),
                    pd_config(num_blocks=32), seed=tick, max_delay=max_delay)
            pd.aborts = {tick: ["j0"]}
            outputs = pd.run(jobs)  # _check_end: no block, no snapshot left anywhere
            assert outputs["j1"] == expected(jobs[1].prompt, jobs[1].sampling)
            found.update(pd.aborted_in)
    assert {
        (None, None),  # waiting for a reservation
        (S.RUNNING_PREFILL, S.RESERVED),
        (S.RUNNING_DECODE, S.RESERVED),  # its first token sampled, not yet handed off
        (S.HANDING_OFF, S.RESERVED),
        (S.HANDED_OFF, S.RESUMING),
        (S.HANDED_OFF, S.RUNNING_DECODE),
    } <= found, found


@settings(parent=settings.get_profile(PROFILE), max_examples=40)
@given(st.integers(0, 2**16), st.integers(0, 2), st.sampled_from(sorted(DECODE_CONFIGS)),
       st.data())
def test_random_pd_runs_match_the_mixed_core(
    seed: int, max_delay: int, decode: str, data: st.DataObject
) -> None:
    jobs = make_jobs(data.draw(st.integers(1, 8)), seed)
    rids = [j.request_id for j in jobs]
    prefill = make_config(num_blocks=data.draw(st.sampled_from([12, 32])))
    decode_config = DECODE_CONFIGS[decode]
    if data.draw(st.booleans()):  # some reservations expire before their KV arrives
        decode_config = replace(decode_config, reservation_timeout_s=0.05)
    pd = PD(prefill, decode_config, seed=seed, max_delay=max_delay)
    pd.fail_handoffs = set(data.draw(st.lists(st.sampled_from(rids), max_size=2)))
    pd.lose = data.draw(st.dictionaries(
        st.sampled_from(rids), st.sampled_from(sorted(LOSSES.values(), key=str)), max_size=2))
    aborted = data.draw(st.lists(st.tuples(st.integers(0, 12), st.sampled_from(rids)),
                                 max_size=2))
    for tick, rid in aborted:
        pd.aborts.setdefault(tick, []).append(rid)
    outputs = pd.run(jobs)
    want = mixed_outputs(jobs)
    for rid, got in outputs.items():
        if pd.finished[rid] is not S.FINISHED_ABORTED:
            assert got == want[rid], rid


# ---------------------------------------------- decode instance, random histories


# "steps": 1-4 steps; "wait": up to 0.4 s of a 0.5 s reservation timeout.
OPS = st.lists(st.tuples(
    st.sampled_from(["reserve", "reserve", "start", "start", "land", "land", "fail", "steps",
                     "steps", "wait", "abort"]),
    st.integers(0, 99)), min_size=20, max_size=80)


@settings(parent=settings.get_profile(PROFILE), max_examples=120)
@given(st.sampled_from([1, 2, 4]), st.integers(4, 24), st.booleans(), OPS)
def test_random_decode_instance_histories_keep_every_invariant(
    block_size: int, num_blocks: int, full: bool, ops: list[tuple[str, int]]
) -> None:
    """Random interleavings of reserve, expiry, remote decodes (restores that
    land or fail), steps and aborts on a decode core."""
    clock = Clock(0.0)
    ratio: dict[str, object] = (
        {"init_new_token_ratio": 1.0, "min_new_token_ratio_factor": 1.0} if full else
        {"init_new_token_ratio": 0.3, "new_token_ratio_decay_steps": 3})
    config = make_config(num_blocks=num_blocks, block_size=block_size, max_num_seqs=4,
                         reservation_timeout_s=0.5, preemption_mode=PreemptionMode.RECOMPUTE,
                         role=Role.DECODE, **ratio)
    side = Side(config, clock)
    core = side.core
    restores: list[RestoreCommand] = []
    outputs: dict[str, list[int]] = {}
    prompts: dict[str, tuple[list[int], SamplingParams]] = {}
    finished: dict[str, RequestStatus] = {}
    num_answers = 0

    def live(wanted: RequestStatus | None = None) -> list[str]:
        return sorted(rid for rid, r in core.life.requests.items()
                      if wanted is None or r.status is wanted)

    def land(cmd: RestoreCommand, ok: bool) -> None:
        if ok:
            side.worker.write(cmd.block_ids, 0, prompts[cmd.request_id][0])
        core.finish_restore(cmd, 128 if ok else None)

    for n, (op, x) in enumerate(ops):
        if op == "reserve":
            rid = f"r{n}"
            prompt, sampling = prompt_of(1 + x % 9, n), greedy(2 + x % 7)
            try:
                accepted = core.pd.reserve(rid, prompt, sampling)
            except InvalidArgument:
                continue  # too big for the pool
            num_answers += 1
            if accepted:
                prompts[rid] = (prompt, sampling)
                if full:
                    pool = core.kv.pool
                    assert pool.num_allocatable_blocks >= core.admission.blocks_kept_back()
        elif op == "start" and (reserved := live(S.RESERVED)):
            rid = reserved[x % len(reserved)]
            restores.append(start_remote(side, rid, land=False))
            outputs[rid] = side.truth[rid][-1:]
            if x % 2:  # its copy lands at once
                land(restores.pop(), True)
        elif op in ("land", "fail") and restores:
            land(restores.pop(x % len(restores)), op == "land")
        elif op == "steps":
            for _ in range(1 + x % 4):
                _, updates = side.step()
                for update in updates:
                    outputs[update.request_id].extend(update.new_token_ids)
                    if update.finish_status is not None:
                        finished[update.request_id] = update.finish_status
                assert all(r.reserved_until > clock.now for r in core.life.reserved.values())
        elif op == "wait":
            clock.now += x / 250
        elif op == "abort" and (everyone := live()):
            rid = everyone[x % len(everyone)]
            core.abort(rid)
            finished[rid] = S.FINISHED_ABORTED
        core.check_integrity()
        stats = core.stats()
        assert stats.num_reserved == len(core.life.reserved)
        assert stats.num_reservations_accepted + stats.num_reservations_refused == num_answers
        if full:
            assert stats.num_preemptions_offload == stats.num_preemptions_recompute == 0
    # Run what is left to its end, its copies landed.
    for cmd in restores:
        land(cmd, True)
    clock.now += 1.0
    while core.has_unfinished_requests:
        _, updates = side.step()
        for update in updates:
            outputs[update.request_id].extend(update.new_token_ids)
            if update.finish_status is not None:
                finished[update.request_id] = update.finish_status
    core.take_snapshots_to_delete()
    assert pool_is_clean(core) and core.is_idle
    stats = core.stats()
    assert stats.num_reservations_accepted == len(prompts)
    # Only those that finished here count: aborted or expired, a prefill
    # instance's request counts there.
    assert stats.num_finished == sum(s is not S.FINISHED_ABORTED for s in finished.values())
    for rid, status_ in finished.items():
        if status_ is not S.FINISHED_ABORTED and rid in outputs:
            prompt, sampling = prompts[rid]
            assert outputs[rid] == expected(prompt, sampling), rid


@pytest.mark.parametrize(("tokens", "finish"), [
    ([VOCAB], None),            # outside the vocabulary
    ([STOP, 5], None),          # goes on after a stop token
    ([1, STOP], None),          # a stop token without a finish: more may follow
    ([1, 2, 3, 4], None),       # max_tokens 5 reached (one came from the prefill), no finish
    ([1, 2, 3, 4, 5], None),    # beyond max_tokens 5
    ([1, 2], "stop"),           # a stop finish without a stop token
    ([1, 2], "length"),         # a length finish short of max_tokens
    ([1, 2, 3, STOP], "stop"),  # a stop finish at max_tokens (there a length end)
    ([1, STOP], "length"),      # a length finish on a stop token short of max_tokens
])
def test_a_decode_instance_cannot_send_impossible_tokens(
        tokens: list[int], finish: str | None) -> None:
    """What a decode instance could not have generated is refused, nothing
    recorded: the engine then takes the request back (a lost instance)."""
    side = Side(prefill_config())
    core = side.core
    cmd, _ = handed_off(side, max_tokens=5, stop=(STOP,))
    assert core.pd.finish_handoff(cmd, 512)
    req = core.get_request("a")
    assert req is not None
    before = list(req.output_token_ids)
    with pytest.raises(InvalidArgument):
        if finish is None:
            core.pd.remote_tokens("a", tokens)
        else:
            core.pd.finish_remote("a", tokens, finish == "stop", RequestUsage(6, 5, 0, 0, 0, None))
    assert req.output_token_ids == before and req.status is S.HANDED_OFF
    core.pd.take_back("a")
    core.check_integrity()
    assert req.status is S.OFFLOADED  # no token was recorded: resumes from the snapshot
