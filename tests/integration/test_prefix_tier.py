"""The prefix tier over real processes: two instances (each a scheduler and
its worker) sharing one cache service. A prompt prefilled on one is loaded,
not prefilled, on the other, and the outputs are the model's own greedy ones.
Both schedulers run with --check-integrity (a broken invariant exits them)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvstash.client import Client
from kvstash.launch.stack import Stack, StackConfig, running_stack
from kvstash.v1 import scheduler_pb2
from tests.integration.reference import reference_greedy

SEGMENT_TOKENS = 32  # two blocks of 16
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def two_instances() -> Iterator[Stack]:
    with running_stack(StackConfig(
            instances=2, num_blocks=128,
            scheduler_args=("--check-integrity", "--prefix-segment-tokens",
                            str(SEGMENT_TOKENS)))) as stack:
        yield stack


async def complete(address: str, prompt: list[int]) -> list[int]:
    async with Client(address) as client:
        result = await client.complete(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    return list(result.token_ids)


async def stats_when(address: str, done: object, timeout_s: float = 20.0
                     ) -> scheduler_pb2.SchedulerStats:
    """The instance's stats once `done(stats)` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with Client(address) as client:
        while True:
            stats = await client.stats()
            if done(stats):  # type: ignore[operator]
                return stats
            assert loop.time() < deadline, f"never reached: {stats}"
            await asyncio.sleep(0.05)


async def test_a_prompt_prefilled_on_one_instance_is_loaded_on_the_other(
        two_instances: Stack) -> None:
    a, b = two_instances.addresses
    prompt = [(7 * j + 3) % 256 for j in range(100)]  # 3 segments and 4 tokens
    expected = reference_greedy(prompt, MAX_TOKENS)
    assert await complete(a, prompt) == expected
    saved = await stats_when(a, lambda s: s.num_tier_saves == 3)
    assert saved.num_tier_save_failures == 0 and saved.bytes_tier_saved > 0
    assert await complete(b, prompt) == expected
    loaded = await stats_when(b, lambda s: s.num_finished == 1)
    assert loaded.num_tier_hit_tokens == 3 * SEGMENT_TOKENS
    assert loaded.bytes_tier_loaded == saved.bytes_tier_saved
    assert (loaded.num_tier_saves, loaded.num_tier_load_failures) == (0, 0)
    # A conversation's next turn extends the prompt: its first three segments
    # come from the tier again, the new ones are saved by the instance
    # that prefilled them.
    longer = prompt + [(5 * j + 1) % 256 for j in range(60)]
    assert await complete(b, longer) == reference_greedy(longer, MAX_TOKENS)
    turn = await stats_when(b, lambda s: s.num_tier_saves == 2)
    assert turn.num_tier_hit_tokens == 3 * SEGMENT_TOKENS  # its own blocks were still there
