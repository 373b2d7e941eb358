"""The prefix tier in the core: which segments are saved and when, what
admission loads, and how a load that fails or a request aborted mid-load ends."""

from __future__ import annotations

import pytest

from kvstash.common.layout import Layout
from kvstash.common.sampling import SamplingParams
from kvstash.v1 import worker_pb2
from scheduler_svc.core.lifecycle import LOADING, RUNNING_DECODE, RUNNING_PREFILL, WAITING
from scheduler_svc.core.outputs import PrefixLoad
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.flags import build_config, parse_args
from tests.scheduler_svc.factories import make_scheduler, step, teach_costs

SEGMENT_BLOCKS = 2  # block_size 4: segments of 8 tokens
PROMPT = list(range(10, 30))  # 20 tokens: 2 whole segments and 4 tokens


def segment_ids(core: Scheduler, prompt: list[int]) -> list[str]:
    return core.prefix_segment_ids(core.prompt_block_hashes(prompt))


def tiered(salt: str = "model-a|float32|4 layers", **overrides: object) -> Scheduler:
    return make_scheduler(prefix_segment_blocks=SEGMENT_BLOCKS, prefix_tier_salt=salt,
                          **overrides)


def add(core: Scheduler, request_id: str, prompt: list[int] = PROMPT,
        stored: int | None = 0) -> None:
    core.add_request(request_id, prompt, SamplingParams(4), stored_segments=stored)


def save_all(core: Scheduler) -> list[str]:
    """Steps `core` until its prefills completed; lands every save; the ids saved."""
    saved = []
    for _ in range(4):
        out, _ = step(core)
        for save in out.prefix_saves:
            core.finish_prefix_save(save, 100)
            saved.append(save.snapshot_id)
    core.check_integrity()
    return saved


def test_a_prefilled_prompt_saves_its_whole_segments_once_holding_their_blocks() -> None:
    core = tiered()
    add(core, "a")
    step(core)  # the whole prompt in one chunk: decoding now
    assert core.get_request("a").status is RUNNING_DECODE
    out = core.schedule()
    saves = out.prefix_saves
    assert [len(s.block_ids) for s in saves] == [2, 2] and all(s.shared_prefix for s in saves)
    assert [s.num_tokens for s in saves] == [8, 8]
    assert saves[0].snapshot_id == segment_ids(core, PROMPT)[0]
    pool = core.kv.pool
    held = saves[0].block_ids + saves[1].block_ids
    assert [pool.ref_cnt(b) for b in held] == [2, 2, 2, 2]  # the request's and the save's
    core.update(out, {"a": 1})
    core.check_integrity()
    core.abort("a")  # the saves keep their blocks from reuse
    assert [pool.ref_cnt(b) for b in held] == [1, 1, 1, 1]
    for save in saves:
        core.finish_prefix_save(save, 512)
    assert [pool.ref_cnt(b) for b in held] == [0, 0, 0, 0]
    stats = core.stats()
    assert (stats.num_tier_saves, stats.bytes_tier_saved) == (2, 1024)
    core.check_integrity()
    add(core, "b", stored=None)  # again, the cache not answering: known stored, not sent
    assert save_all(core) == []


def test_a_segment_the_cache_lost_since_it_was_saved_is_saved_again() -> None:
    """Segments are unpinned: the cache evicts them. A lookup made after the
    save that finds none is believed; one made before the save landed is not."""
    core = tiered()
    add(core, "a")
    saved = save_all(core)
    assert len(saved) == 2 and core.get_request("a") is None  # finished
    core.reset_prefix_cache()  # prefilled again here, as after the pool evicted a's blocks
    add(core, "b")  # its lookup found none: the cache evicted them
    assert save_all(core) == saved


def test_a_segment_saved_after_a_lookup_that_missed_it_is_not_sent_again() -> None:
    core = tiered(max_num_seqs=1)
    add(core, "a")
    step(core)  # a prefilled: its segments go out next step
    add(core, "b")  # its lookup finds none: they land after it, while b waits
    assert len(save_all(core)) == 2  # a's; b's prefill (its 4th step) sends none
    assert core.get_request("b").status is RUNNING_DECODE
    assert save_all(core) == []


def test_no_segment_is_saved_while_the_cache_does_not_answer() -> None:
    """A save to a cache that hangs would pin its blocks until it timed out."""
    core = tiered()
    core.set_cache_available(False)
    add(core, "a")
    assert save_all(core) == []
    core.set_cache_available(True)
    add(core, "b")
    assert len(save_all(core)) == 2


def test_a_prompt_whose_lookup_went_unanswered_saves_the_segments_never_saved_here() -> None:
    """No answer (the lookup timed out, or was refused) leaves "saved here
    ever" as what is known stored: a segment never saved here is not."""
    core = tiered()
    add(core, "a", stored=None)
    assert save_all(core) == segment_ids(core, PROMPT)


def test_a_failed_save_is_counted_and_tried_again_by_the_next_prompt() -> None:
    core = tiered()
    add(core, "a")
    step(core)
    out, _ = step(core)
    for save in out.prefix_saves:
        core.finish_prefix_save(save, None)
    assert core.stats().num_tier_save_failures == 2
    add(core, "b")
    assert len(save_all(core)) == 2


def test_segment_ids_name_the_prefix_and_the_salt() -> None:
    ids = segment_ids(tiered(), PROMPT)
    assert len(ids) == 2 and ids == segment_ids(tiered(), PROMPT)
    assert segment_ids(tiered(salt="model-b|float32|4 layers"), PROMPT)[0] != ids[0]
    other = [10, 11, 12, 13, 14, 15, 16, 17, 99, 99, 99, 99, 99, 99, 99, 99]
    assert segment_ids(tiered(), other) == [ids[0], segment_ids(tiered(), other)[1]]
    assert segment_ids(tiered(), other)[1] != ids[1]
    assert segment_ids(make_scheduler(), PROMPT) == []  # no tier


def test_segment_ids_name_the_segment_size() -> None:
    """Instances of one model with other --prefix-segment-tokens share a
    cache: a 1-block segment is never read as a 2-block one ending at the
    same block."""
    one_block = make_scheduler(prefix_segment_blocks=1, prefix_tier_salt="model-a|float32|4 layers")
    assert not set(segment_ids(tiered(), PROMPT)) & set(segment_ids(one_block, PROMPT))


def test_the_salt_follows_the_weights_not_only_their_name() -> None:
    """Two checkpoints mounted at the chart's /models (a fine-tune and its
    base) have one name: their segments must still differ."""
    args = parse_args(["--cache-address", "127.0.0.1:1"])
    layout = Layout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")

    def salt(weights_id: str, numerics: str = "cpu AVX2|torch 2.13.0|whole steps") -> str:
        info = worker_pb2.WorkerInfo(
            model_name="models", vocab_size=64, max_model_len=256, num_blocks=32,
            model_type="llama", architectures=["LlamaForCausalLM"], weights_id=weights_id,
            numerics=numerics)
        return build_config(args, info, layout).prefix_tier_salt

    assert salt("a") == salt("a") != salt("b")
    # Nor do workers share segments whose steps write other bits for the same
    # tokens (another GPU, a step that is not batch-invariant).
    assert salt("a") != salt("a", "cpu AVX2|torch 2.13.0|plain steps")
    assert salt("a") != salt("a", "NVIDIA H100|torch 2.13.0|whole steps")


def load_of(core: Scheduler, request_id: str, stored: int) -> PrefixLoad:
    add(core, request_id, stored=stored)
    out, _ = step(core)
    assert len(out.prefix_loads) == 1
    assert request_id not in {s.request_id for s in out.seqs}  # no chunk while loading
    assert core.get_request(request_id).status is LOADING
    return out.prefix_loads[0]


def test_admission_loads_stored_segments_and_prefills_only_the_rest() -> None:
    writer = tiered()
    add(writer, "a")
    saved = save_all(writer)
    core = tiered()  # another instance: an empty pool
    load = load_of(core, "b", stored=2)
    assert [s.snapshot_id for s in load.segments] == saved
    assert all(s.keep for s in load.segments)
    req = core.get_request("b")
    assert [s.block_ids for s in load.segments] == [req.block_ids[0:2], req.block_ids[2:4]]
    core.finish_prefix_load(load, 2, 1024, 0.01)
    assert req.status is RUNNING_PREFILL and req.num_computed_tokens == 16
    out, updates = step(core)
    assert [(s.start_pos, len(s.token_ids)) for s in out.seqs] == [(16, 4)]
    assert updates[0].num_cached_tokens == 16
    stats = core.stats()
    assert (stats.num_tier_hit_tokens, stats.bytes_tier_loaded) == (16, 1024)
    assert save_all(core) == []  # what it loaded is stored


def test_nothing_is_loaded_while_the_cache_does_not_answer() -> None:
    """Its lookup found segments just before the cache stopped answering:
    a load would only wait out its bound, so the request prefills."""
    core = tiered()
    core.set_cache_available(False)
    add(core, "b", stored=2)
    out, _ = step(core)
    assert out.prefix_loads == [] and core.get_request("b").status is RUNNING_DECODE


def test_a_failed_segment_is_prefilled_with_everything_after_it() -> None:
    core = tiered()
    load = load_of(core, "b", stored=2)
    core.finish_prefix_load(load, 1, 512)
    assert core.stats().num_tier_load_failures == 1
    out, _ = step(core)
    assert [(s.start_pos, len(s.token_ids)) for s in out.seqs] == [(8, 12)]


def test_the_last_prompt_token_is_always_computed() -> None:
    core = tiered()
    prompt = PROMPT[:16]  # exactly two segments
    add(core, "b", prompt=prompt, stored=2)
    out, _ = step(core)
    assert len(out.prefix_loads[0].segments) == 1


def test_the_local_prefix_cache_comes_first() -> None:
    core = tiered()
    add(core, "a")
    save_all(core)
    step(core)
    add(core, "b", stored=2)  # the pool still holds the prompt's blocks
    out, _ = step(core)
    assert out.prefix_loads == [] and core.get_request("b").num_cached_tokens == 16


def test_a_partial_local_hit_loads_from_its_segment_boundary() -> None:
    core = tiered()
    add(core, "a", prompt=PROMPT[:12])  # caches blocks 0-2 locally: 1.5 segments
    save_all(core)
    load = load_of(core, "b", stored=2)
    assert len(load.segments) == 1  # segment 1 only; segment 0 is the local hit
    req = core.get_request("b")
    assert req.num_computed_tokens == 8 and load.segments[0].block_ids == req.block_ids[2:4]
    core.finish_prefix_load(load, 1, 512)
    assert req.num_computed_tokens == 16
    core.check_integrity()


def test_an_abort_while_loading_frees_the_blocks_when_the_load_lands() -> None:
    core = tiered()
    load = load_of(core, "b", stored=2)
    blocks = list(core.get_request("b").block_ids)
    core.abort("b")
    core.check_integrity()
    assert core.kv.pool.ref_cnt(blocks[0]) == 1 and not core.is_idle
    core.finish_prefix_load(load, 1, 512)  # the rest cut short by the abort
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks and core.is_idle
    stats = core.stats()  # read, but neither a hit nor a failure
    assert (stats.bytes_tier_loaded, stats.num_tier_hit_tokens,
            stats.num_tier_load_failures) == (512, 0, 0)
    core.check_integrity()


def test_a_load_predicted_dearer_than_its_prefill_is_declined() -> None:
    core = tiered()
    costs = core.preemption.costs
    teach_costs(costs, offload=(0.01, 0.001), restore=(5.0, 1.0), prefill=(1e-4, 0.0))
    add(core, "b", stored=2)
    out, _ = step(core)
    assert out.prefix_loads == [] and core.stats().num_tier_loads_declined == 1
    assert core.get_request("b").status is RUNNING_DECODE


def test_a_declined_load_is_counted_once_when_admitted_not_each_step_it_waits() -> None:
    core = tiered(num_blocks=12)
    teach_costs(core.preemption.costs, offload=(0.01, 0.001), restore=(5.0, 1.0),
                prefill=(1e-4, 0.0))
    # x holds 10 of the 12 blocks for 8 steps; b (5 blocks) waits for it.
    core.add_request("x", list(range(40, 80)), SamplingParams(8, ignore_eos=True))
    step(core)
    add(core, "b", stored=2)
    num_waited = -1
    while core.get_request("b").status is WAITING:
        assert core.stats().num_tier_loads_declined == 0
        for save in step(core)[0].prefix_saves:
            core.finish_prefix_save(save, 512)
        num_waited += 1
    assert num_waited >= 3 and core.get_request("x") is None
    assert core.stats().num_tier_loads_declined == 1


def test_an_operators_flush_keeps_the_saves_not_yet_sent() -> None:
    """The blocks still hold their KV (only the local prefix cache is
    forgotten): the saves queued, holding their blocks, still go out."""
    core = tiered()
    add(core, "a")
    step(core)
    core.reset_prefix_cache(kv_lost=False)
    saves = core.schedule().prefix_saves
    assert [s.snapshot_id for s in saves] == segment_ids(core, PROMPT)
    core.abort("a")
    for save in saves:
        core.finish_prefix_save(save, 512)
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
    core.check_integrity()


def test_a_lost_worker_drops_the_saves_not_yet_sent() -> None:
    core = tiered()
    add(core, "a")
    step(core)
    core.reset_prefix_cache()  # the worker restarted: its blocks hold nothing
    core.abort("a")
    assert core.schedule().prefix_saves == []
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
    core.check_integrity()


def test_a_tier_needs_a_salt() -> None:
    with pytest.raises(ValueError, match="salt"):
        make_scheduler(prefix_segment_blocks=2)


def test_a_failed_load_saves_what_it_prefilled_instead() -> None:
    core = tiered()
    load = load_of(core, "b", stored=2)
    core.finish_prefix_load(load, 1, 512)
    step(core)
    out = core.schedule()
    assert [s.block_ids for s in out.prefix_saves] == [core.get_request("b").block_ids[2:4]]


def finish(core: Scheduler, request_id: str) -> list[str]:
    """Steps until `request_id` finished, landing every save; the ids saved."""
    saved = []
    while core.get_request(request_id) is not None:
        for save in step(core)[0].prefix_saves:
            core.finish_prefix_save(save, 512)
            saved.append(save.snapshot_id)
    return saved


def test_write_back_saves_a_prompt_only_when_its_blocks_are_about_to_be_evicted() -> None:
    core = tiered(prefix_write="back")  # 64 blocks; one step may take 16
    add(core, "a")
    finish(core, "a")
    assert core.stats().num_tier_saves == 0 and core.tier.saves == {}
    ids = segment_ids(core, PROMPT)
    a_blocks = list(core.kv.pool.evictable_in_order())
    # A long prompt takes all but 8 free blocks: a's are next to go.
    core.add_request("big", [(7 * i) % 90 + 5 for i in range(200)], SamplingParams(4))
    step(core)
    out, _ = step(core)
    # The segment evicted first (the prompt's tail) goes first.
    assert [s.snapshot_id for s in out.prefix_saves] == ids[::-1]
    held = [b for s in out.prefix_saves for b in s.block_ids]
    assert set(held) <= set(a_blocks) and all(core.kv.pool.ref_cnt(b) == 1 for b in held)
    for save in out.prefix_saves:
        core.finish_prefix_save(save, 512)
    core.check_integrity()
    saved = finish(core, "big")
    add(core, "c", prompt=[(3 * i) % 90 + 5 for i in range(200)])
    saved += finish(core, "c")  # evicts a's blocks (and big's, written back first)
    assert saved and not set(saved) & set(ids)  # a's: stored already, not sent again
    core.check_integrity()


def test_write_back_saves_what_one_admission_would_evict_before_it_does() -> None:
    """One admission can evict far more than the blocks write-back keeps free
    (one step's worth): the noted segments among what it would evict are
    saved first, and it waits for them to land."""
    core = tiered(prefix_write="back", num_blocks=53)
    add(core, "a")
    finish(core, "a")
    ids = segment_ids(core, PROMPT)
    assert core.kv.pool.num_free_blocks >= 16  # no write-back at the step's start
    # Needs every free block and more of a's than write-back's margin.
    core.add_request("big", [(7 * i) % 90 + 5 for i in range(200)], SamplingParams(4))
    out, _ = step(core)
    assert sorted(s.snapshot_id for s in out.prefix_saves) == sorted(ids)
    assert core.get_request("big").status is WAITING  # the saves hold what it needs
    for save in out.prefix_saves:
        core.finish_prefix_save(save, 512)
    out, _ = step(core)
    assert out.prefix_saves == [] and core.get_request("big").status is not WAITING
    assert core.stats().num_tier_saves == 2
    core.check_integrity()


def test_write_back_saves_the_segments_of_a_prompt_whose_lookup_went_unanswered() -> None:
    core = tiered(prefix_write="back", num_blocks=53)
    add(core, "a", stored=None)
    finish(core, "a")
    core.add_request("big", [(7 * i) % 90 + 5 for i in range(200)], SamplingParams(4))
    out, _ = step(core)  # evicts a's blocks: saved first
    assert sorted(s.snapshot_id for s in out.prefix_saves) == sorted(segment_ids(core, PROMPT))


def test_write_back_never_saves_blocks_evicted_before_it_saw_them() -> None:
    core = tiered(prefix_write="back", num_blocks=53)
    add(core, "a")
    finish(core, "a")
    # The cache down, one admission takes every free block and a's two oldest
    # evictable (its tail, segment 1's last block among them), unsaved.
    core.set_cache_available(False)
    core.add_request("big", [(7 * i) % 90 + 5 for i in range(200)], SamplingParams(4))
    out, _ = step(core)
    assert out.prefix_saves == [] and core.get_request("big").status is not WAITING
    core.set_cache_available(True)
    saves = [s.snapshot_id for _ in range(4) for s in step(core)[0].prefix_saves]
    assert saves == segment_ids(core, PROMPT)[:1]


def test_kv_events_announce_loaded_blocks_only_once_they_are_in_the_pool() -> None:
    core = tiered()
    core.record_kv_events()
    load = load_of(core, "b", stored=2)
    assert core.take_kv_events() == []  # allocated, still being read: not announced
    core.finish_prefix_load(load, 2, 1024)
    stored = core.take_kv_events()
    assert len(stored) == 4  # the four blocks of the two segments, now in the pool
    assert [e.block_hash for e in stored] == core.get_request("b").block_hashes[:4]


def test_decodes_wait_for_the_blocks_write_back_saves_instead_of_preempting() -> None:
    """Write-back pins the blocks the pool was about to hand out; until those
    saves land, a decode short of a block waits, as for an offload's blocks,
    instead of preempting another decode that fits without the tier."""
    core = tiered(num_blocks=40, reservation_policy="fixed_blocks", fixed_blocks_per_decode=0,
                  preemption_mode="recompute", prefix_write="back")
    core.add_request("a", list(range(1, 33)), SamplingParams(1))  # 8 blocks, done at once
    step(core)
    for rid, first in (("d1", 50), ("d2", 10)):  # 20 blocks each at their end: all 40
        core.add_request(rid, [first + i % 37 for i in range(64)],
                         SamplingParams(16, ignore_eos=True))
    saves = []
    for _ in range(8):
        out, _ = step(core)
        assert out.preempted == []
        saves += out.prefix_saves
    assert saves  # a's segments, written back as the pool ran short
    for save in saves:
        core.finish_prefix_save(save, 100)
    while core.get_request("d1") or core.get_request("d2"):
        out, _ = step(core)
        assert out.preempted == []
    core.check_integrity()
