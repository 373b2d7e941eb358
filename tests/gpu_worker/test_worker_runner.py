"""ModelRunner input validation: every bad step is refused before any KV is written."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.runner import ModelRunner, SeqWork
from gpu_worker.step_graphs import StepGraphs
from kvstash.errors import InvalidArgument
from tests.gpu_worker.worker_factories import make_runner, tiny_model

GOOD = SeqWork("good", [1, 2, 3], 0, [0], sample=True)


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        (SeqWork("r", [], 0, [1]), "no token_ids"),
        (SeqWork("r", [5, 258, 300], 0, [1]), r"token ids \[258, 300\] outside vocab of 258"),
        (SeqWork("r", [5], 1024, [1] * 300), r"positions 1024..1024 exceed max_model_len 1024"),
        (SeqWork("r", [5, 6], 7, [1, 2]), r"9 positions need 3 blocks of 4, block table has 2"),
        (SeqWork("r", [5], 0, [64]), r"block ids \[64\] outside \[0, 64\)"),
        # One block for two places of one table: positions 4.. would overwrite 0..
        (SeqWork("r", [5, 6, 7, 8, 9], 0, [1, 1]),
         r"block table names blocks \[1\] more than once in the 2 blocks its 5 positions use"),
        (SeqWork("r", [5], 4, [2, 2, 3]), r"blocks \[2\] more than once"),
    ],
)
def test_bad_sequence_is_refused_and_cache_untouched(seq: SeqWork, message: str) -> None:
    runner = make_runner()
    before = runner.kv_cache.clone()
    with pytest.raises(InvalidArgument, match=message):
        runner.execute([GOOD, seq])  # the good one comes first and still must not run
    assert torch.equal(runner.kv_cache, before)


def test_two_requests_writing_one_slot_are_refused() -> None:
    runner = make_runner()
    with pytest.raises(InvalidArgument, match="'a' and 'b' both write block 3 offset 1"):
        runner.execute([SeqWork("a", [1, 2], 0, [3]), SeqWork("b", [4], 1, [3])])
    with pytest.raises(InvalidArgument, match="'a' appears twice"):
        runner.execute([SeqWork("a", [1], 0, [3]), SeqWork("a", [4], 0, [5])])


def test_a_block_one_request_writes_is_in_no_other_table_of_the_step() -> None:
    """A block a buggy scheduler gave to two requests: b's cached KV in block 1
    must not be overwritten by a's new KV (nor read as b's by b)."""
    runner = make_runner()
    runner.execute([SeqWork("b", [10, 11, 12, 13, 14, 15], 0, [0, 1])])
    before = runner.kv_cache.clone()
    with pytest.raises(InvalidArgument,
                       match="request 'a' writes block 1, which request 'b' also holds"):
        runner.execute([SeqWork("a", [20, 21], 0, [1]),
                        SeqWork("b", [16], 6, [0, 1], True)])
    with pytest.raises(InvalidArgument, match="request 'a' writes block 0, which request 'b'"):
        runner.execute([SeqWork("b", [16], 6, [0, 1], True),
                        SeqWork("a", [20], 4, [5, 0])])
    assert torch.equal(runner.kv_cache, before)


def test_shared_read_only_prefix_blocks_are_allowed() -> None:
    runner = make_runner()
    runner.execute([SeqWork("prefix", [10, 11, 12, 13], 0, [0])])
    out = runner.execute([SeqWork("a", [20], 4, [0, 1], True), SeqWork("b", [21], 4, [0, 2], True)])
    assert all(isinstance(t, int) for t in out)


def test_execute_returns_none_for_non_sampling_seqs() -> None:
    runner = make_runner()
    out = runner.execute([SeqWork("a", [1, 2], 0, [0]), SeqWork("b", [3], 0, [1], True)])
    assert out[0] is None and isinstance(out[1], int)


def test_max_model_len_cap() -> None:
    runner = ModelRunner(tiny_model(), block_size=4, num_blocks=8, max_model_len=10)
    assert runner.max_model_len == 10
    with pytest.raises(InvalidArgument, match=r"positions 8\.\.10 exceed max_model_len 10"):
        runner.execute([SeqWork("r", [1, 2, 3], 8, [0, 1, 2])])


def test_a_one_position_context_starts_and_serves_one_token_prompts() -> None:
    """--max-model-len 1 is accepted: the start-up check of whole steps has
    no decode to try there (it once failed with an IndexError)."""
    runner = ModelRunner(tiny_model(), block_size=4, num_blocks=8, max_model_len=1)
    assert runner.batched.whole
    out = runner.execute([SeqWork("a", [5], 0, [0], True), SeqWork("b", [6], 0, [1], True)])
    assert all(isinstance(t, int) for t in out)
    with pytest.raises(InvalidArgument, match=r"positions 1\.\.1 exceed max_model_len 1"):
        runner.execute([SeqWork("a", [out[0]], 1, [0], True)])


def test_max_model_len_past_the_models_own_is_refused() -> None:
    assert ModelRunner(tiny_model(), block_size=4, num_blocks=8,
                       max_model_len=1024).max_model_len == 1024
    with pytest.raises(ValueError, match="max_model_len 1025 is more than the model's own 1024"):
        ModelRunner(tiny_model(), block_size=4, num_blocks=8, max_model_len=1025)


def test_a_kv_cache_larger_than_the_device_is_refused_naming_num_blocks() -> None:
    with pytest.raises(ValueError, match=r"num_blocks 1099511627776 of 4 tokens need a KV "
                                         r"cache of .* GiB, more than the .* GiB of the cpu"):
        make_runner(num_blocks=2**40, block_size=4)


def test_cuda_graphs_are_for_whole_invariant_steps_on_cuda_only() -> None:
    """On the CPU the setting is moot: no graphs, asked for or not."""
    runner = ModelRunner(tiny_model(), block_size=4, num_blocks=8, cuda_graph_rows=512)
    assert runner.batched.whole and runner.batched.graphs is None
    runner.batched.use_graphs(512)
    assert runner.batched.graphs is None


def test_a_row_count_whose_graphs_fail_to_capture_runs_op_by_op(
        caplog: pytest.LogCaptureFixture) -> None:
    """Where a row count's CUDA graphs cannot be captured (here for real: the
    CPU has no CUDA), its steps run op by op with the same bits, and the
    capture is not tried again at every step."""
    graphed, eager = make_runner(), make_runner()
    graphed.batched.graphs = StepGraphs(graphed.batched, max_rows=512)
    prefill = [SeqWork("a", [1, 2, 3, 4, 5], 0, [0, 1]), SeqWork("b", [6, 7], 0, [2])]
    decode = [SeqWork("a", [8], 5, [0, 1]), SeqWork("b", [9], 2, [2])]
    for seqs in (prefill, decode, decode):  # 8 rows, then 4 twice
        assert torch.equal(graphed.logits(seqs), eager.logits(seqs))
    layers = tiny_model().config.num_layers
    assert graphed.batched.graphs.failed == {(8, layers), (4, layers)}
    assert graphed.batched.graphs.captured == []
    assert torch.equal(graphed.kv_cache, eager.kv_cache)
    warned = [r for r in caplog.records if "no CUDA graphs" in r.getMessage()]
    assert [r.getMessage().split(":")[0] for r in warned] == [
        "no CUDA graphs for steps of 8 rows", "no CUDA graphs for steps of 4 rows"]
