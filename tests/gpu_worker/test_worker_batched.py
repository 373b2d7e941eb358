"""The batched step: one forward for every sequence of a step, bitwise the same
per row as each sequence alone, in float32 and bf16 (not only float64).

The workload test is the project's oracle at the runner level: greedy outputs
with preemption by offload (blocks copied out and back into other blocks) and
by recompute (prompt + output prefilled again, in other chunks, beside other
requests) equal those of each request run alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from gpu_worker.attention import AttentionBackend, varlen_options
from gpu_worker.invariance import rows_match_alone
from gpu_worker.runner import ModelRunner, SeqWork
from gpu_worker.sampling import GREEDY
from kvstash.common.sampling import SamplingParams
from tests.gpu_worker.oracle import execute_per_sequence, reference_forward
from tests.gpu_worker.worker_factories import BLOCK_SIZE, make_runner, prompt, tiny_model

DTYPES = [torch.float32, torch.bfloat16]
# Whole steps (the CPU default: each op once over the step) and tiles of 16
# rows (GPUs, and the CPU where the start-up check fails).
ROW_TILES = [None, 16]
TABLE_BLOCKS = 20  # per request: 80 positions, more than prompt + output
PROMPTS = {f"r{i}": prompt(("kvstash stashes KV blocks " * 8)[i:i + 9 + 7 * i]) for i in range(6)}


def tables(first: int = 0, num_blocks: int = 40) -> dict[str, list[int]]:
    return {rid: list(range(first + num_blocks * i, first + num_blocks * (i + 1)))
            for i, rid in enumerate(PROMPTS)}


@pytest.mark.parametrize("row_tile", ROW_TILES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_prefill_equals_each_prompt_alone(dtype: torch.dtype,
                                                 row_tile: int | None) -> None:
    alone, batched = (make_runner(dtype, num_blocks=256, row_tile=row_tile) for _ in range(2))
    table = tables()
    together = batched.logits([SeqWork(r, ids, 0, table[r]) for r, ids in PROMPTS.items()])
    for row, (rid, ids) in zip(together, PROMPTS.items(), strict=True):
        assert torch.equal(row, alone.logits([SeqWork(rid, ids, 0, table[rid])])[0])
        reference = reference_forward(tiny_model(dtype), torch.tensor(ids))[-1]
        tolerance = 1e-4 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(row, reference, atol=tolerance, rtol=tolerance)


def mixed_steps(alone: ModelRunner, batched: ModelRunner) -> int:
    """Random subsets in random order; some rows are prefill chunks of a second
    prompt that arrives late, packed beside the decodes. Each row against the
    same sequence run alone on `alone`: the number of rows that differ."""
    rng = random.Random(3)
    table = tables()
    for rid, ids in PROMPTS.items():  # prefill "r0".."r4" first, "r5" in chunks later
        if rid != "r5":
            alone.logits([SeqWork(rid, ids, 0, table[rid])])
            batched.logits([SeqWork(rid, ids, 0, table[rid])])
    last = {rid: ids[-1] for rid, ids in PROMPTS.items()}
    pos = {rid: len(ids) - 1 for rid, ids in PROMPTS.items()}  # recompute the last prompt token
    late, late_done, differ = PROMPTS["r5"], 0, 0
    for _ in range(16):
        seqs = [SeqWork(r, [last[r]], pos[r], table[r]) for r in PROMPTS
                if r != "r5" and rng.random() < 0.7]
        if late_done < len(late):
            piece = late[late_done:late_done + 5]
            seqs.append(SeqWork("r5", piece, late_done, table["r5"]))
            late_done += len(piece)
        rng.shuffle(seqs)
        if not seqs:
            continue
        for seq, row in zip(seqs, batched.logits(seqs), strict=True):
            reference = alone.logits([seq])[0]
            differ += not torch.equal(row, reference)
            if seq.request_id != "r5" or late_done >= len(late):
                last[seq.request_id] = int(reference.argmax())
                pos[seq.request_id] = seq.start_pos + len(seq.token_ids)
    return differ


@pytest.mark.parametrize("row_tile", ROW_TILES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_and_decode_steps_are_row_invariant(dtype: torch.dtype,
                                                          row_tile: int | None) -> None:
    runners = [make_runner(dtype, num_blocks=256, row_tile=row_tile) for _ in range(2)]
    assert mixed_steps(*runners) == 0


def test_the_checks_tell_a_path_that_is_not_invariant() -> None:
    """The same steps without batch invariance (each op once over the
    unpadded rows): some rows differ, so the checks above would catch a
    path that lost it."""
    runners = [make_runner(num_blocks=256, batch_invariant=False) for _ in range(2)]
    assert mixed_steps(*runners) > 0
    assert not rows_match_alone(runners[0].batched, BLOCK_SIZE)
    assert rows_match_alone(make_runner().batched, BLOCK_SIZE)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_lone_decode_at_a_chunk_end_has_the_bits_it_has_in_company(dtype: torch.dtype) -> None:
    """A decode reading exactly one 128-key chunk, no mask, alone in its step:
    its tile group is one (tile, chunk) pair, where K^T once reached the
    product as a transposed view (a reshape of [1, kv, d, C] copies nothing)
    and MKL gave a float64 row other bits than beside another decode (found
    in review, 2026-11-28)."""
    def decode_logits(runner: ModelRunner, company: bool) -> torch.Tensor:
        ids = prompt(("stash " * 22)[:127])
        other = [SeqWork("b", ids[:50], 0, list(range(20, 24)))] if company else []
        runner.logits([SeqWork("a", ids, 0, list(range(1, 9))), *other])
        step = [SeqWork("a", [65], 127, list(range(1, 9)))]  # context 128: one chunk
        if company:
            step.append(SeqWork("b", [66], 50, list(range(20, 24))))
        return runner.logits(step)[0]

    alone = decode_logits(make_runner(dtype, block_size=16), company=False)
    assert torch.equal(alone, decode_logits(make_runner(dtype, block_size=16), company=True))


def test_shared_prefix_blocks_are_read_through_each_block_table() -> None:
    """Two sequences whose tables share the prompt's blocks: each reads the
    prefix KV another step wrote, through its own table."""
    runner, reference = make_runner(), make_runner()
    shared = prompt("shared prefix!..")  # 16 tokens = 4 whole blocks
    runner.execute([SeqWork("p", shared, 0, [0, 1, 2, 3])])
    a = SeqWork("a", prompt("one"), 16, [0, 1, 2, 3, 10])
    b = SeqWork("b", prompt("two"), 16, [0, 1, 2, 3, 20])
    both = runner.logits([a, b])
    for seq, row in zip((a, b), both, strict=True):
        full = reference.logits([SeqWork(seq.request_id, shared + list(seq.token_ids), 0,
                                         [30, 31, 32, 33, 34])])[0]
        assert torch.equal(row, full)


def test_batched_and_per_sequence_paths_agree_in_float64() -> None:
    """The old path (one forward per sequence) and the batched one compute the
    same function; in float64 their greedy tokens agree."""
    new, old = (make_runner(torch.float64, num_blocks=128) for _ in range(2))
    table = tables(num_blocks=16)
    seqs = [SeqWork(r, ids, 0, table[r], True) for r, ids in PROMPTS.items()]
    for _ in range(8):
        tokens_new = new.execute(seqs)
        assert execute_per_sequence(old, seqs) == tokens_new
        seqs = [SeqWork(s.request_id, [t], s.start_pos + len(s.token_ids), s.block_ids, True)
                for s, t in zip(seqs, tokens_new, strict=True) if t is not None]


def test_fast_mode_is_correct_but_not_row_invariant() -> None:
    """batch_invariant=False runs each op once over all rows: right to rounding."""
    fast = ModelRunner(tiny_model(), block_size=BLOCK_SIZE, num_blocks=256,
                       batch_invariant=False)
    table = tables()
    together = fast.logits([SeqWork(r, ids, 0, table[r]) for r, ids in PROMPTS.items()])
    for row, ids in zip(together, PROMPTS.values(), strict=True):
        reference = reference_forward(tiny_model(), torch.tensor(ids))[-1]
        torch.testing.assert_close(row, reference, atol=1e-4, rtol=1e-4)


# ---- the oracle: preemption by offload and by recompute --------------------


@dataclass(slots=True)
class Request:
    rid: str
    prompt: list[int]
    table: list[int]
    output: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose KV is in `table`
    sampling: SamplingParams = GREEDY


class Blocks:
    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def step_work(req: Request, chunk: int) -> SeqWork:
    """The next chunk of the prompt-plus-output history, or the decode token."""
    history = req.prompt + req.output
    if req.computed < len(history) - 1 or not req.output:
        end = min(req.computed + chunk, len(history) if not req.output else len(history) - 1)
        samples = end == len(history) and not req.output
        return SeqWork(req.rid, history[req.computed:end], req.computed, req.table, samples,
                       req.sampling)
    return SeqWork(req.rid, [req.output[-1]], req.computed, req.table, True, req.sampling)


def run(runner: ModelRunner, requests: list[Request], max_tokens: int, chunk: int,
        preempt: dict[int, tuple[str, str]] | None = None, done: list[str] | None = None
        ) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Steps until every request has max_tokens; `preempt[step] = (rid, mode)`.
    Returns each request's output and the logits after its last token: equal
    logits bit for bit mean equal KV all along, not just lucky argmaxes.
    `done` collects the preemptions that happened."""
    blocks, step = Blocks(), 0
    for req in requests:
        req.table = blocks.take(TABLE_BLOCKS)
    while any(len(r.output) < max_tokens for r in requests):
        rid, mode = (preempt or {}).get(step, ("", ""))
        victim = next((r for r in requests if r.rid == rid and 0 < len(r.output) < max_tokens),
                      None)
        if victim is not None:
            old, victim.table = victim.table, blocks.take(TABLE_BLOCKS)
            used = -(-victim.computed // BLOCK_SIZE)
            if mode == "offload":
                runner.scatter_blocks(victim.table[:used], runner.gather_blocks(old[:used]))
            else:  # recompute prompt and output, in chunks of another size
                victim.computed = 0
                chunk += 2
            runner.kv_cache[:, :, torch.tensor(old)] = float("nan")  # the old blocks are gone
            (done if done is not None else []).append(f"{rid} {mode}")
        live = [r for r in requests if len(r.output) < max_tokens]
        seqs = [step_work(r, chunk) for r in live]
        for req, seq, token in zip(live, seqs, runner.execute(seqs), strict=True):
            req.computed = seq.start_pos + len(seq.token_ids)
            if token is not None and req.computed == len(req.prompt) + len(req.output):
                req.output.append(token)
        step += 1
    return {r.rid: (r.output, runner.logits([step_work(r, chunk)])[0]) for r in requests}


@pytest.mark.parametrize("row_tile", ROW_TILES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_outputs_survive_offload_and_recompute(dtype: torch.dtype,
                                                      row_tile: int | None) -> None:
    max_tokens = 16
    alone = {rid: run(make_runner(dtype, num_blocks=256, row_tile=row_tile),
                      [Request(rid, ids, [])], max_tokens, chunk=8)[rid]
             for rid, ids in PROMPTS.items()}
    preempt = {6: ("r1", "offload"), 8: ("r3", "recompute"), 11: ("r0", "recompute"),
               13: ("r5", "offload"), 15: ("r1", "recompute")}
    done: list[str] = []
    together = run(make_runner(dtype, num_blocks=256, row_tile=row_tile),
                   [Request(rid, ids, []) for rid, ids in PROMPTS.items()], max_tokens,
                   chunk=5, preempt=preempt, done=done)
    assert done == [f"{rid} {mode}" for rid, mode in preempt.values()]
    for rid, (output, logits) in alone.items():
        assert together[rid][0] == output, rid
        assert torch.equal(together[rid][1], logits), rid
    assert len({tuple(output) for output, _ in alone.values()}) > 3


SEEDED = [SamplingParams(64, temperature=1.3, seed=11),
          SamplingParams(64, temperature=0.8, top_k=5, seed=12),
          SamplingParams(64, temperature=1.0, top_p=0.7, seed=13), GREEDY,
          SamplingParams(64, temperature=2.0, top_k=40, top_p=0.9, seed=14),
          SamplingParams(64, temperature=1.1, seed=15)]


def test_seeded_samples_survive_offload_and_recompute() -> None:
    """The oracle for random sampling: a seeded draw depends on its seed,
    position and logits only, so neighbours with filters, preemption and
    recompute in other chunks leave every token as the request alone draws it."""
    def requests(rids: list[str]) -> list[Request]:
        return [Request(rid, PROMPTS[rid], [], sampling=SEEDED[int(rid[1:])]) for rid in rids]

    alone = {rid: run(make_runner(torch.float32, num_blocks=256), requests([rid]), 12,
                      chunk=8)[rid]
             for rid in PROMPTS}
    preempt = {6: ("r1", "offload"), 8: ("r2", "recompute"), 10: ("r4", "recompute"),
               12: ("r5", "offload"), 13: ("r1", "recompute")}
    done: list[str] = []
    together = run(make_runner(torch.float32, num_blocks=256), requests(list(PROMPTS)), 12,
                   chunk=5, preempt=preempt, done=done)
    assert done == [f"{rid} {mode}" for rid, mode in preempt.values()]
    assert {rid: output for rid, (output, _) in together.items()} == {
        rid: output for rid, (output, _) in alone.items()}


def test_step_without_sampling_rows_returns_nones() -> None:
    runner = make_runner()
    assert runner.execute([SeqWork("a", [1, 2, 3], 0, [0], False, GREEDY)]) == [None]
    assert runner.execute([]) == []


def test_flash_attention_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"flash attention needs CUDA .* got cpu"):
        ModelRunner(tiny_model(), block_size=BLOCK_SIZE, num_blocks=8,
                    attention=AttentionBackend.FLASH)


# varlen_attn's keyword-only parameters as torch releases have them.
def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                 return_aux=None): ...


def _varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                 scale=None, window_size=(-1, -1)): ...


def _varlen_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                 scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                 block_table=None, num_splits=None): ...


@pytest.mark.parametrize(("varlen", "invariant", "keywords", "repeat_kv"), [
    (_varlen_2_12, True, {"window_size": (-1, 0), "num_splits": 1, "enable_gqa": True}, False),
    (_varlen_2_12, False, {"window_size": (-1, 0), "enable_gqa": True}, False),
    (_varlen_2_11, True, {"window_size": (-1, 0)}, True),
    (_varlen_2_10, False, {"is_causal": True}, True),
    (_varlen_2_10, True, None, None),  # may split a row's keys: the torch path then
])
def test_flash_is_called_as_the_installed_torch_takes_it(varlen, invariant, keywords,
                                                          repeat_kv) -> None:
    """The GPU machine's torch may be older than this one's: every keyword
    passed must exist there, and batch invariance must not be promised where
    the kernel cannot keep it."""
    options = varlen_options(varlen, invariant)
    if keywords is None:
        assert options is None
        return
    assert options is not None
    assert (options.keywords, options.repeat_kv) == (keywords, repeat_kv)
    # This machine's torch: whatever its release, its signature is understood.
    from torch.nn.attention.varlen import varlen_attn
    assert varlen_options(varlen_attn, invariant) is not None
