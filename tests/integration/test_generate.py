"""End to end over real processes: concurrent generation and bad input."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc

from kvstash import errors
from kvstash.client import Client
from kvstash.common.tokenizer import load_tokenizer
from kvstash.launch.stack import Stack, StackConfig, running_stack
from tests.gpu_worker.test_worker_checkpoint import LLAMA, tokenizer_json, write_checkpoint
from tests.integration.reference import reference_greedy
from tests.integration.workload import wait_drained

PROMPTS = [[(i * 37 + j * 11) % 256 for j in range(5 + 9 * i)] for i in range(6)]


async def test_concurrent_greedy_equals_model_run_directly(stack: Stack) -> None:
    async with Client(stack.address) as client:
        results = await asyncio.gather(*[
            client.complete(prompt, max_tokens=24, ignore_eos=True) for prompt in PROMPTS])
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.finish_reason == "length"
        assert result.usage is not None and result.usage.completion_tokens == 24
        assert result.usage.prompt_tokens == len(prompt)
        assert result.token_ids == reference_greedy(prompt, 24)


async def test_text_prompt_streams_text(stack: Stack) -> None:
    async with Client(stack.address) as client:
        deltas = [d async for d in client.generate("hello kvstash", max_tokens=8)]
    assert deltas[-1].finish_reason in ("stop", "length")
    assert deltas[-1].usage is not None and deltas[-1].usage.prompt_tokens == len("hello kvstash")
    assert sum(len(d.token_ids) for d in deltas) == deltas[-1].usage.completion_tokens
    assert deltas[-1].usage.ttft_s > 0


async def test_stop_token_finishes_with_stop(stack: Stack) -> None:
    prompt = PROMPTS[2]
    expected = reference_greedy(prompt, 12)
    stop = expected[5]
    async with Client(stack.address) as client:
        result = await client.complete(prompt, max_tokens=12, stop_token_ids=[stop],
                                       ignore_eos=True)
    assert result.finish_reason == "stop"
    assert result.token_ids == expected[: expected.index(stop) + 1]


@pytest.mark.parametrize(
    ("prompt", "kwargs", "error", "message"),
    [
        ("", {}, errors.InvalidArgument, "prompt is empty"),
        ([], {}, errors.InvalidArgument, "prompt is empty"),
        ([1] * 2000, {}, errors.InvalidArgument, "max_model_len"),
        ([1, 2, 3], {"max_tokens": 5000}, errors.InvalidArgument, "max_model_len"),
        ([1, 2, 999999], {}, errors.InvalidArgument, "999999"),
        ([1, 2, 3], {"temperature": -1.0}, errors.InvalidArgument, "temperature"),
        ([1, 2, 3], {"top_p": 1.5}, errors.InvalidArgument, "top_p"),
        ([1, 2, 3], {"request_id": "../bad id"}, errors.InvalidArgument, "request_id"),
    ],
)
async def test_bad_input_is_refused_and_service_keeps_serving(
    stack: Stack, prompt: object, kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    async with Client(stack.address) as client:
        with pytest.raises(error, match=message):
            await client.complete(prompt, **kwargs)  # type: ignore[arg-type]
        ok = await client.complete([5, 6, 7], max_tokens=3, ignore_eos=True)
    assert ok.token_ids == reference_greedy([5, 6, 7], 3)


async def test_max_tokens_zero_refused_by_the_server(stack: Stack) -> None:
    # The Python client refuses it locally; a raw gRPC caller reaches the server.
    from kvstash.common import rpc_connections
    from kvstash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

    async with rpc_connections.insecure_channel(stack.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        call = stub.Generate(scheduler_pb2.GenerateRequest(
            token_ids=scheduler_pb2.TokenIds(ids=[1, 2]),
            sampling=common_pb2.SamplingParams(max_tokens=0)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in (info.value.details() or "")


async def test_abort_unknown_request_is_not_found(stack: Stack) -> None:
    async with Client(stack.address) as client:
        with pytest.raises(errors.NotFound, match="no-such-request"):
            await client.abort("no-such-request")


async def test_abort_running_request_frees_its_blocks(stack: Stack) -> None:
    async with Client(stack.address) as client:
        before = await client.stats()
        stream = client.generate([9, 8, 7], max_tokens=500, ignore_eos=True,
                                 request_id="to-abort")
        first = await stream.__anext__()
        assert first.token_ids
        await client.abort("to-abort")
        rest = [d async for d in stream]
        assert rest[-1].finish_reason == "abort"
        after = await client.stats()
    assert after.num_running_decode == 0 and after.num_waiting == 0
    assert after.num_free_blocks + after.num_evictable_blocks == before.num_total_blocks


async def test_client_disconnect_releases_the_request(stack: Stack) -> None:
    async with Client(stack.address) as client:
        stream = client.generate([4, 5, 6], max_tokens=1000, ignore_eos=True)
        assert (await stream.__anext__()).token_ids
        await stream.aclose()  # cancels the call, as a vanished client would
    # 1000 decode steps take several seconds; being drained sooner means aborted.
    stats = await wait_drained(stack.address, timeout_s=1.5)
    assert stats.num_running_decode == stats.num_running_prefill == stats.num_waiting == 0
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_total_blocks


async def test_a_checkpoints_text_reads_after_the_prompt(tmp_path: Path) -> None:
    """A token's text can depend on the one before it: the checkpoint's
    word-level tokenizer writes the space before each word but a text's
    first. The first output token was decoded as a text's first, so its
    space was lost (the reply ran into the prompt: "kv cacheworld world"),
    and a stop string " world" could not match it."""
    model = tmp_path / "tiny-llama"
    model.mkdir()
    write_checkpoint(model, LLAMA, shards=1)
    tokenizer = load_tokenizer(tokenizer_json(), LLAMA["vocab_size"], (1,))
    prompt = "kv cache"  # greedy: "world" (3), again and again
    with running_stack(StackConfig(model=str(model), num_blocks=64), tmp_path) as stack:
        async with Client(stack.address) as client:
            result = await client.complete(prompt, max_tokens=3, ignore_eos=True)
        async with grpc.aio.insecure_channel(stack.address) as channel:
            [stopped] = [r.complete async for r in vllm_engine_pb2_grpc.VllmEngineStub(
                channel).Generate(pb.GenerateRequest(
                    request_id="stop-at-a-word", text=prompt, sampling_params=pb.SamplingParams(
                        temperature=0.0, max_tokens=3, ignore_eos=True, stop=[" world"])))]
    prompt_ids = tokenizer.encode(prompt)
    assert result.token_ids == [3, 3, 3]
    assert result.text == " world world world"
    assert tokenizer.decode(prompt_ids + result.token_ids) == prompt + result.text
    assert (list(stopped.output_ids), stopped.matched_stop_str) == ([3], " world")
