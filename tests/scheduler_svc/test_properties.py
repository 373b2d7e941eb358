"""Random workloads through the whole core: the scheduler must never lose,
duplicate or corrupt a request, whatever the pressure, aborts and copy failures."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstash.common.sampling import SamplingParams
from scheduler_svc.core.config import PreemptionMode, ReservationPolicy, SchedulerConfig
from scheduler_svc.core.request import RequestStatus
from tests.scheduler_svc.conftest import PROFILE
from tests.scheduler_svc.harness import AbortPlan, Arrival, Harness

LIVE_STATUSES = [s for s in RequestStatus if not s.is_finished]
VOCAB_SIZE = 24
EOS = 0
BASE_PROMPTS = ((5, 6, 7, 8, 9, 10, 11, 12, 13), (5, 6, 7, 8, 20, 21), (14, 15, 16))


@st.composite
def arrivals(
    draw: st.DrawFn, max_requests: int = 12, max_step: int = 12, ignore_eos: bool | None = None
) -> list[Arrival]:
    num = draw(st.integers(1, max_requests))
    result = []
    for i in range(num):
        # Shared prefixes exercise prefix caching; suffixes make them diverge.
        base = draw(st.sampled_from(BASE_PROMPTS))
        prefix = base[: draw(st.integers(0, len(base)))]
        suffix = draw(st.lists(st.integers(1, VOCAB_SIZE - 1), max_size=12))
        prompt = tuple(prefix) + tuple(suffix) or (1,)
        sampling = SamplingParams(
            max_tokens=draw(st.integers(1, 32)),
            stop_token_ids=tuple(draw(st.lists(st.integers(1, VOCAB_SIZE - 1), max_size=1))),
            ignore_eos=draw(st.booleans()) if ignore_eos is None else ignore_eos,
        )
        step = draw(st.integers(0, max_step))
        result.append(Arrival(step, f"req/{i}", prompt, sampling))
    return result


@st.composite
def scenarios(
    draw: st.DrawFn, pressure: bool = False
) -> tuple[SchedulerConfig, list[Arrival], list[AbortPlan], dict]:
    """pressure: everything arrives at once, runs long, and admission reserves nothing."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    reqs = draw(arrivals(max_step=2, ignore_eos=True) if pressure else arrivals())
    need = max(-(-(len(a.prompt) + a.sampling.max_tokens) // block_size) for a in reqs)
    # Tiny pools: just enough for the largest request, plus a little.
    num_blocks = need + draw(st.integers(0, 4))
    max_num_seqs = draw(st.integers(1, 8))
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=128,
        vocab_size=VOCAB_SIZE,
        eos_token_ids=(EOS,),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + draw(st.integers(0, 16)),
        reservation_policy=(
            ReservationPolicy.FIXED_BLOCKS if pressure else draw(st.sampled_from(ReservationPolicy))
        ),
        fixed_blocks_per_decode=0 if pressure else draw(st.integers(0, 2)),
        new_token_ratio_decay_steps=draw(st.sampled_from([1, 10, 600])),
        retract_steps=draw(st.integers(0, 20)),
        preemption_mode=draw(st.sampled_from(PreemptionMode)),
        bytes_per_block=draw(st.sampled_from([0, 100])),
        resume_headroom=draw(st.integers(0, 2)),
    )
    aborts = draw(st.lists(
        st.builds(AbortPlan, st.integers(0, 60), st.integers(0, len(reqs) - 1), st.booleans()),
        max_size=3,
    ))
    transport = {
        "seed": draw(st.integers(0, 2**32)),
        "fail_rate": draw(st.sampled_from([0.0, 0.0, 0.3, 1.0])),
        "max_delay": draw(st.integers(0, 4)),
        "capacity_choices": draw(st.sampled_from([(10**12,), (None, 10**12), (0, 300, 10**12)])),
        "abort_statuses": draw(st.frozensets(st.sampled_from(LIVE_STATUSES))),
        "abort_rate": draw(st.sampled_from([0.0, 0.03, 0.2])),
    }
    return config, reqs, aborts, transport


@settings(parent=settings.get_profile(PROFILE))
@given(scenarios())
def test_random_workloads_keep_every_invariant(scenario) -> None:
    config, reqs, aborts, transport = scenario
    Harness(config, **transport).run(reqs, aborts)


@settings(parent=settings.get_profile(PROFILE))
@given(scenarios(pressure=True))
def test_pressured_workloads_keep_every_invariant(scenario) -> None:
    """Everything arrives at once with no reservation: preemption on most steps."""
    config, reqs, aborts, transport = scenario
    Harness(config, **transport).run(reqs, aborts)


@settings(parent=settings.get_profile(PROFILE), max_examples=30)
@given(arrivals(max_requests=8), st.integers(0, 2**32))
def test_pressured_run_matches_unpressured_run(reqs: list[Arrival], seed: int) -> None:
    """Same tokens with a huge pool and with the smallest pool that fits."""
    def run(num_blocks: int, mode: PreemptionMode):
        config = SchedulerConfig(
            num_blocks=num_blocks, block_size=2, max_model_len=128, vocab_size=VOCAB_SIZE,
            eos_token_ids=(EOS,), max_num_seqs=8, max_num_batched_tokens=16,
            preemption_mode=mode,
        )
        return Harness(config, seed=seed).run(reqs).outputs

    need = max(-(-(len(a.prompt) + a.sampling.max_tokens) // 2) for a in reqs)
    unpressured = run(4096, PreemptionMode.AUTO)
    assert run(need, PreemptionMode.OFFLOAD) == unpressured
    assert run(need, PreemptionMode.RECOMPUTE) == unpressured
