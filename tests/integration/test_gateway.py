"""vllm.grpc.engine.VllmEngine on the scheduler's port, called directly and
through the real smg gateway (OpenAI HTTP) on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from kvstash.client import Client
from kvstash.launch.gateway import running_gateway
from kvstash.launch.openai_http import (
    REPLACEMENT,
    HttpError,
    request_json,
    sse_events,
    stream_completion,
)
from kvstash.launch.stack import Stack, StackConfig, running_stack
from kvstash.v1 import scheduler_pb2
from tests.gpu_worker.test_worker_checkpoint import LLAMA, write_checkpoint
from tests.integration.workload import PRESSURED_BLOCKS, PRESSURED_SCHEDULER_ARGS

PROMPT = [104, 101, 108, 108, 111, 32, 107, 118]  # "hello kv"


def greedy(max_tokens: int, **fields: object) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                             **fields)  # type: ignore[arg-type]


async def kvstash_tokens(stack: Stack, prompt: list[int] | str, max_tokens: int) -> list[int]:
    async with Client(stack.address) as client:
        return (await client.complete(prompt, max_tokens=max_tokens, ignore_eos=True)).token_ids


@pytest.fixture
async def engine(stack: Stack) -> vllm_engine_pb2_grpc.VllmEngineStub:
    channel = grpc.aio.insecure_channel(stack.address)
    yield vllm_engine_pb2_grpc.VllmEngineStub(channel)
    await channel.close()


async def test_generate_streams_the_tokens_kvstash_generates(
        stack: Stack, engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    expected = await kvstash_tokens(stack, PROMPT, 12)
    chunks = [r async for r in engine.Generate(pb.GenerateRequest(
        request_id="vllm-stream", tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=greedy(12), stream=True))]
    *deltas, last = chunks
    assert all(c.WhichOneof("response") == "chunk" for c in deltas)
    assert [t for c in deltas for t in c.chunk.token_ids] == expected
    assert all(c.chunk.prompt_tokens == len(PROMPT) for c in deltas)
    assert sum(c.chunk.completion_tokens for c in deltas) == 12
    complete = last.complete
    assert (complete.finish_reason, complete.completion_tokens) == ("length", 12)
    # As vLLM's: the tokens of the update that finished it, just sent as a chunk.
    assert list(complete.output_ids) == list(deltas[-1].chunk.token_ids) == expected[-1:]
    # Not streamed: one complete with every token; text input tokenized here.
    [only] = [r async for r in engine.Generate(pb.GenerateRequest(
        request_id="vllm-once", text="hello kv", sampling_params=greedy(12)))]
    assert list(only.complete.output_ids) == expected


async def test_cached_tokens_count_the_prompt_found_in_the_prefix_cache(
        engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    prompt = [(i * 37 + 11) % 250 for i in range(40)]  # this test's own: two full blocks
    cached = []
    for i in range(2):
        [only] = [r async for r in engine.Generate(pb.GenerateRequest(
            request_id=f"vllm-cached-{i}", tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=greedy(2)))]
        cached.append(only.complete.cached_tokens)
    assert cached == [0, 32]
    # Streamed: on every chunk too, as vLLM sends it.
    *chunks, last = [r async for r in engine.Generate(pb.GenerateRequest(
        request_id="vllm-cached-streamed", tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=greedy(3), stream=True))]
    assert [c.chunk.cached_tokens for c in chunks] == [32, 32, 32]
    assert last.complete.cached_tokens == 32


async def test_a_stop_token_is_reported_as_the_matched_stop(
        stack: Stack, engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    tokens = await kvstash_tokens(stack, PROMPT, 6)
    [only] = [r async for r in engine.Generate(pb.GenerateRequest(
        request_id="vllm-stop", tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=greedy(6, stop_token_ids=[tokens[3]])))]
    complete = only.complete
    assert list(complete.output_ids) == tokens[:4]
    assert complete.finish_reason == "stop" and complete.matched_token_id == tokens[3]


# Sampled at temperature 1.0 with this seed, the tiny model ends PROMPT with
# its EOS (257) after 30 tokens; with SEED_EOS - 1, not in 64.
SEED_EOS = 6


async def test_the_models_eos_is_no_matched_stop(
        engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    """As vLLM's: matched_token_id is a token of the request's stop_token_ids
    only; EOS ends a sequence as "stop" with no matched stop, even where the
    request lists it among its stop ids too (found in review, 2026-11-28)."""
    for stop_ids in ([], [257]):
        [only] = [r async for r in engine.Generate(pb.GenerateRequest(
            request_id=f"vllm-eos-{len(stop_ids)}", tokenized=pb.TokenizedInput(
                input_ids=PROMPT), sampling_params=pb.SamplingParams(
                    temperature=1.0, seed=SEED_EOS, max_tokens=64, stop_token_ids=stop_ids)))]
        complete = only.complete
        assert (complete.finish_reason, complete.output_ids[-1]) == ("stop", 257)
        assert complete.WhichOneof("matched_stop") is None


def first_ascii_pair(tokens: list[int]) -> int:
    """The index of the first of two printable ASCII bytes in a row: as text
    they are exactly these two characters, wherever they stand."""
    return next(i for i in range(len(tokens) - 1)
                if all(32 < t < 127 for t in tokens[i:i + 2]))


async def test_a_stop_string_ends_the_request_at_the_token_that_completes_it(
        stack: Stack, engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    tokens = await kvstash_tokens(stack, PROMPT, 64)
    i = first_ascii_pair(tokens)
    stop = bytes(tokens[i:i + 2]).decode()
    async with Client(stack.address) as client:
        before = (await client.stats()).num_generation_tokens
    for stream in (True, False):
        responses = [r async for r in engine.Generate(pb.GenerateRequest(
            request_id=f"vllm-stop-string-{stream}", tokenized=pb.TokenizedInput(
                input_ids=PROMPT), sampling_params=greedy(64, stop=["never made", stop]),
            stream=stream))]
        complete = responses[-1].complete
        chunks = [list(r.chunk.token_ids) for r in responses[:-1]]
        sent = [t for c in chunks for t in c] + ([] if stream else list(complete.output_ids))
        assert sent == tokens[:i + 2]
        if stream:  # it repeats the chunk whose text completed the stop string
            assert list(complete.output_ids) == chunks[-1]
        assert (complete.finish_reason, complete.matched_stop_str) == ("stop", stop)
        assert complete.completion_tokens == i + 2
    stats = await _settled(stack.address)
    # Released at the match, not run on to max_tokens (a step may overshoot).
    assert stats.num_generation_tokens - before < 2 * (i + 2) + 8
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_total_blocks


async def seeded_tokens(stack: Stack, prompt: list[int] | str, max_tokens: int,
                        seeds: range) -> list[list[int]]:
    """kvstash's own tokens for each seed, sampled at temperature 0.8."""
    async with Client(stack.address) as client:
        return [(await client.complete(prompt, max_tokens=max_tokens, ignore_eos=True,
                                       temperature=0.8, seed=seed)).token_ids
                for seed in seeds]


async def test_n_sequences_stream_by_index_each_as_its_seed_makes_it(
        stack: Stack, engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    expected = await seeded_tokens(stack, PROMPT, 10, range(40, 43))
    assert len({tuple(t) for t in expected}) == 3  # the seeds do differ
    params = pb.SamplingParams(temperature=0.8, seed=40, n=3, max_tokens=10, ignore_eos=True)
    for stream in (True, False):
        responses = [r async for r in engine.Generate(pb.GenerateRequest(
            request_id=f"vllm-n-{stream}", tokenized=pb.TokenizedInput(input_ids=PROMPT),
            sampling_params=params, stream=stream))]
        got: dict[int, list[int]] = {0: [], 1: [], 2: []}
        completes = {}
        for r in responses:
            if r.WhichOneof("response") == "chunk":
                got[r.chunk.index] += r.chunk.token_ids
            else:
                completes[r.complete.index] = r.complete
                if stream:  # the tokens of its last chunk, again
                    assert list(r.complete.output_ids) == expected[r.complete.index][-1:]
                else:
                    got[r.complete.index] += r.complete.output_ids
        assert [got[i] for i in range(3)] == expected
        assert sorted(completes) == [0, 1, 2]
        assert all(c.finish_reason == "length" and c.completion_tokens == 10
                   for c in completes.values())


async def test_n_sequences_not_streamed_end_together_in_index_order(
        stack: Stack, engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    """Sequence 1 ends at its EOS long before sequence 0 ends at max_tokens;
    not streamed, both come once the request is done, 0 first, as vLLM's."""
    expected = await seeded_eos_tokens(stack, range(SEED_EOS - 1, SEED_EOS + 1), 64)
    assert len(expected[1]) < len(expected[0]) == 64
    responses = [r async for r in engine.Generate(pb.GenerateRequest(
        request_id="vllm-n-order", tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=pb.SamplingParams(temperature=1.0, seed=SEED_EOS - 1, n=2,
                                          max_tokens=64)))]
    assert [r.complete.index for r in responses] == [0, 1]
    assert [list(r.complete.output_ids) for r in responses] == expected
    assert [r.complete.finish_reason for r in responses] == ["length", "stop"]


async def seeded_eos_tokens(stack: Stack, seeds: range, max_tokens: int) -> list[list[int]]:
    """kvstash's own tokens for each seed at temperature 1.0, EOS applying."""
    async with Client(stack.address) as client:
        return [(await client.complete(PROMPT, max_tokens=max_tokens, temperature=1.0,
                                       seed=seed)).token_ids for seed in seeds]


async def test_n_sequences_share_the_prompts_blocks(
        engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    """The first sequence goes alone until its first token; the others then
    find its prompt's full blocks in the prefix cache."""
    prompt = [(i * 53 + 7) % 250 for i in range(40)]  # this test's own: two full blocks
    cached: dict[int, set[int]] = {0: set(), 1: set()}
    async for r in engine.Generate(pb.GenerateRequest(
            request_id="vllm-n-shared", tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=greedy(4, n=2), stream=True)):
        reply = getattr(r, r.WhichOneof("response"))
        cached[reply.index].add(reply.cached_tokens)
    assert cached == {0: {0}, 1: {32}}  # every chunk and the complete say it


async def test_max_tokens_unset_runs_to_the_end_of_the_context_and_past_it_is_refused(
        engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    """As kvstash.v1, and vLLM's OpenAI server: max_tokens unset runs to what
    max_model_len (the tiny model's 1024) leaves after the prompt; one past
    it is refused (before: cut there); a prompt that leaves nothing is refused."""
    prompt = [(i * 29 + 5) % 250 for i in range(1020)]
    [only] = [r async for r in engine.Generate(pb.GenerateRequest(
        request_id="vllm-to-the-end", tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(temperature=0.0, ignore_eos=True)))]
    assert (only.complete.finish_reason, len(only.complete.output_ids)) == ("length", 4)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in engine.Generate(pb.GenerateRequest(
                request_id="vllm-past-the-end", tokenized=pb.TokenizedInput(input_ids=prompt),
                sampling_params=greedy(100))):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens 100 does not fit" in err.value.details()
    assert "1020" in err.value.details() and "at most 4" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in engine.Generate(pb.GenerateRequest(
                request_id="vllm-no-room", tokenized=pb.TokenizedInput(input_ids=prompt * 2),
                sampling_params=greedy(4))):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2040" in err.value.details() and "1024" in err.value.details()


async def test_abort_by_the_request_id_ends_all_its_sequences(
        stack: Stack, engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    call = engine.Generate(pb.GenerateRequest(
        request_id="vllm-n-abort", tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=greedy(400, n=2), stream=True))
    await call.read()
    # One call per request id at a time, though its sequences' ids differ.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in engine.Generate(pb.GenerateRequest(
                request_id="vllm-n-abort", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                sampling_params=greedy(4))):
            pass
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    await engine.Abort(pb.AbortRequest(request_ids=["vllm-n-abort"]))
    finishes = []
    while (response := await call.read()) is not grpc.aio.EOF:
        if response.WhichOneof("response") == "complete":
            finishes.append(response.complete.finish_reason)
    assert finishes == ["abort", "abort"]
    stats = await _settled(stack.address)
    assert stats.num_running_decode + stats.num_waiting == 0


async def test_unsupported_requests_say_what_is_not_supported(
        engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    cases = {
        "presence_penalty": (greedy(4, presence_penalty=0.5), grpc.StatusCode.INVALID_ARGUMENT),
        "logprobs": (greedy(4, logprobs=2), grpc.StatusCode.INVALID_ARGUMENT),
        "top_p": (greedy(4, top_p=2.0), grpc.StatusCode.INVALID_ARGUMENT),
        "stop": (greedy(4, stop=[""]), grpc.StatusCode.INVALID_ARGUMENT),
        "n": (greedy(4, n=17), grpc.StatusCode.INVALID_ARGUMENT),
    }
    for name, (params, code) in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in engine.Generate(pb.GenerateRequest(
                    request_id=f"bad-{name.replace('_', '-')}",
                    tokenized=pb.TokenizedInput(input_ids=PROMPT), sampling_params=params)):
                pass
        assert err.value.code() == code and name in err.value.details(), name
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in engine.Generate(pb.GenerateRequest(
                request_id="mm", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                sampling_params=greedy(4), mm_inputs=pb.MultimodalInputs(mm_hashes=["x"]))):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await engine.Embed(pb.EmbedRequest())
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and err.value.details()


async def test_abort_by_id_ends_the_stream_as_aborted(
        stack: Stack, engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    call = engine.Generate(pb.GenerateRequest(
        request_id="vllm-abort", tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=greedy(400), stream=True))
    first = await call.read()
    assert first.chunk.token_ids
    await engine.Abort(pb.AbortRequest(request_ids=["vllm-abort", "never-existed"]))
    last = first
    while (response := await call.read()) is not grpc.aio.EOF:
        last = response
    assert last.complete.finish_reason == "abort"
    async with Client(stack.address) as client:
        stats = await client.stats()
    assert stats.num_running_decode + stats.num_waiting == 0


async def test_info_loads_health_and_tokenizer(
        stack: Stack, engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    info = await engine.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.served_model_name, info.vocab_size, list(info.eos_token_ids)) == (
        "tiny", 258, [257])
    assert (info.model_type, list(info.architectures)) == ("llama", ["LlamaForCausalLM"])
    assert info.max_context_length == 1024
    server = await engine.GetServerInfo(pb.GetServerInfoRequest())
    assert server.block_size == 16 and server.server_type == "vllm-grpc"
    assert server.kv_role == ""
    loads = await engine.GetLoads(pb.GetLoadsRequest())
    assert loads.version.startswith("kvstash ")
    [load] = loads.loads
    assert load.max_total_num_tokens == 256 * 16 and 0 <= load.token_usage <= 1
    assert (await engine.HealthCheck(pb.HealthCheckRequest())).healthy
    chunks = [c async for c in engine.GetTokenizer(common_pb2.GetTokenizerRequest())]
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert "tokenizer.json" in archive.namelist()


async def test_kv_events_follow_the_prefix_cache(
        stack: Stack, engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    """Subscribed, a new 40-token prompt shows up as its two full blocks
    (tokens, parent link); a flush as a Cleared event."""
    events = engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
        start_sequence_number=2**62))  # nothing old: only what happens from now
    await events.initial_metadata()
    prompt = [(7 * i + 3) % 256 for i in range(40)]
    await kvstash_tokens(stack, prompt, 2)
    stored: list[common_pb2.KvBlocksStored] = []
    while len(stored) < 2:
        batch = await asyncio.wait_for(events.read(), 10)
        stored += [e.stored for e in batch.events if e.HasField("stored")
                   and list(e.stored.blocks[0].token_ids) in (prompt[:16], prompt[16:32])]
    first, second = stored
    assert list(first.blocks[0].token_ids) == prompt[:16] and not first.HasField(
        "parent_block_hash")
    assert second.parent_block_hash == first.blocks[0].block_hash
    assert second.blocks[0].block_size == 16
    flushed = await engine.FlushCache(common_pb2.FlushCacheRequest())
    assert flushed.success
    while True:
        batch = await asyncio.wait_for(events.read(), 10)
        if any(e.HasField("cleared") for e in batch.events):
            break
    events.cancel()


# -- through smg --------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two instances sharing a cache, smg in front of both. Their tokens are
    those of the session's `stack`: the same model, the same weights."""
    config = StackConfig(num_blocks=256, instances=2, gateway=True)
    with running_stack(config, tmp_path_factory.mktemp("pair")) as pair:
        yield pair


@pytest.fixture(scope="module")
def gateway(pair: Stack) -> str:
    """The base URL of smg in front of the pair."""
    assert pair.gateway is not None
    return pair.gateway.url


def shown(token_ids: list[int]) -> str:
    """The text smg shows for byte tokens: invalid bytes as U+FFFD, but none
    at the very end (its streaming decoder holds them back for good)."""
    return bytes(token_ids).decode("utf-8", "replace").rstrip("\ufffd")


async def test_smg_lists_the_model_and_completes_as_kvstash_does(
        stack: Stack, gateway: str) -> None:
    models = await asyncio.to_thread(request_json, f"{gateway}/v1/models")
    assert [m["id"] for m in models["data"]] == ["tiny"]
    expected = await kvstash_tokens(stack, "hello kv", 16)
    body = {"model": "tiny", "prompt": "hello kv", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    reply = await asyncio.to_thread(request_json, f"{gateway}/v1/completions", body)
    [choice] = reply["choices"]
    assert choice["text"] == shown(expected) and choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 16
    streamed = await stream_completion(gateway, body)
    assert (streamed.text, streamed.finish_reason, streamed.completion_tokens) == (
        shown(expected), "length", 16)


async def test_smg_passes_stop_strings_and_shows_the_text_before_them(
        stack: Stack, gateway: str) -> None:
    tokens = await kvstash_tokens(stack, "hello kv", 64)
    i = first_ascii_pair(tokens)
    stop = bytes(tokens[i:i + 2]).decode()
    body = {"model": "tiny", "prompt": "hello kv", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "stop": [stop]}
    text = bytes(tokens[:i + 2]).decode("utf-8", "replace")
    before_stop = text[:text.index(stop)]  # the pair's first occurrence: no earlier one
    reply = await asyncio.to_thread(request_json, f"{gateway}/v1/completions", body)
    [choice] = reply["choices"]
    assert (choice["finish_reason"], choice["text"]) == ("stop", before_stop)
    streamed = await stream_completion(gateway, body)
    assert (streamed.finish_reason, streamed.text) == ("stop", before_stop)


async def test_smg_returns_n_choices_for_one_request(stack: Stack, gateway: str) -> None:
    expected = await seeded_tokens(stack, "hello kv", 12, range(5, 7))
    body = {"model": "tiny", "prompt": "hello kv", "max_tokens": 12, "temperature": 0.8,
            "seed": 5, "n": 2, "ignore_eos": True}
    reply = await asyncio.to_thread(request_json, f"{gateway}/v1/completions", body)
    texts = {c["index"]: c["text"] for c in reply["choices"]}
    assert texts == {0: shown(expected[0]), 1: shown(expected[1])}
    assert reply["usage"]["completion_tokens"] == 24
    # Streamed: each choice's text once (a complete repeats its last chunk's
    # tokens, as vLLM's do), and the usage of both.
    streamed = {0: "", 1: ""}
    usage = {}
    async for event in sse_events(f"{gateway}/v1/completions", body | {
            "stream": True, "stream_options": {"include_usage": True}}):
        for choice in event.get("choices") or []:
            streamed[choice["index"]] += choice["text"]
        usage = event.get("usage") or usage
    assert streamed == texts and usage["completion_tokens"] == 24


async def test_smg_chat_applies_the_tiny_template(stack: Stack, gateway: str) -> None:
    prompt = "<|user|>\nhi\n<|assistant|>\n"
    expected = await kvstash_tokens(stack, prompt, 8)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    reply = await asyncio.to_thread(request_json, f"{gateway}/v1/chat/completions", body)
    assert reply["usage"]["prompt_tokens"] == len(prompt.encode())
    assert reply["choices"][0]["message"]["content"] == shown(expected)


# OpenAI fields kvstash cannot honour, as a client sends them through smg,
# with the field smg passes on (the one the error names).
UNSUPPORTED_OVER_HTTP = [
    ("completions", {"logprobs": 2}, "logprobs"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"min_tokens": 2}, "min_tokens"),
    ("chat/completions", {"logprobs": True}, "logprobs"),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "json_schema"),
]


@pytest.mark.parametrize(("endpoint", "field", "named"), UNSUPPORTED_OVER_HTTP,
                         ids=[f"{e}-{n}" for e, _, n in UNSUPPORTED_OVER_HTTP])
async def test_smg_answers_400_for_a_field_kvstash_cannot_honour(
        gateway: str, endpoint: str, field: dict[str, object], named: str) -> None:
    """Before: UNIMPLEMENTED, which smg answers 501 "server_error", so the
    openai SDK retried twice and raised InternalServerError; 400 is not retried."""
    body: dict[str, object] = {"model": "tiny", "max_tokens": 4, "temperature": 0, **field}
    if endpoint == "completions":
        body["prompt"] = "hello kv"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    with pytest.raises(HttpError) as err:
        await asyncio.to_thread(request_json, f"{gateway}/v1/{endpoint}", body)
    assert err.value.status == 400, err.value
    assert f"sampling_params.{named} is not supported" in err.value.body.decode()


async def test_smg_answers_400_for_a_max_tokens_past_the_context(gateway: str) -> None:
    """As vLLM's OpenAI server (before: cut to the room left, 200). Unset runs
    to the context's end (test_max_tokens_unset_runs_to_the_end_of_the_context
    ...; smg leaves it unset)."""
    body = {"model": "tiny", "prompt": "hello kv", "max_tokens": 5000}
    with pytest.raises(HttpError) as err:
        await asyncio.to_thread(request_json, f"{gateway}/v1/completions", body)
    assert err.value.status == 400, err.value
    assert ("max_tokens 5000 does not fit: a prompt of 8 tokens leaves room for at most "
            "1016") in err.value.body.decode()


async def test_smg_routes_a_shared_prefix_to_the_instance_that_holds_it(tmp_path: Path) -> None:
    """The instances' KV events tell smg which one caches a prefix: requests
    sharing it go there and hit its prefix cache."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    config = StackConfig(num_blocks=128)
    with running_stack(config, tmp_path / "a") as a, running_stack(config, tmp_path / "b") as b, \
            running_gateway([a.address, b.address], tmp_path) as gateway:
        url = gateway.url
        prefix = "".join(f"shared context line {i}; " for i in range(12))  # ~270 bytes
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        await asyncio.to_thread(request_json, f"{url}/v1/completions",
                                body | {"prompt": prefix + "q0"})
        await asyncio.sleep(1.0)  # its blocks' events reach smg
        for i in range(1, 5):
            await asyncio.to_thread(request_json, f"{url}/v1/completions",
                                    body | {"prompt": prefix + f"q{i}"})
        hits = []
        for instance in (a, b):
            async with Client(instance.address) as client:
                hits.append((await client.stats()).num_prefix_hit_tokens)
    full_blocks = len(prefix.encode()) // 16 * 16
    assert sorted(hits)[0] == 0, hits  # the other instance never saw the prefix
    assert max(hits) >= 4 * full_blocks, hits


# -- faults behind smg ---------------------------------------------------------


async def _settled(address: str, timeout_s: float = 15.0) -> scheduler_pb2.SchedulerStats:
    """The scheduler's stats once nothing runs or waits any more."""
    deadline = time.monotonic() + timeout_s
    async with Client(address) as client:
        while True:
            stats = await client.stats()
            busy = (stats.num_running_prefill + stats.num_running_decode + stats.num_waiting
                    + stats.num_offloaded)
            if not busy or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.1)


async def test_an_http_client_gone_mid_stream_aborts_the_request_in_kvstash(
        pair: Stack, gateway: str) -> None:
    before = [await _settled(a) for a in pair.addresses]
    body = {"model": "tiny", "prompt": "a long answer, please", "max_tokens": 1000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events = sse_events(f"{gateway}/v1/completions", body)
    async for event in events:
        if event["choices"] and event["choices"][0]["text"]:
            break  # generating: now the client goes away
    await events.aclose()  # closes the connection
    after = [await _settled(a) for a in pair.addresses]
    for stats in after:
        assert stats.num_running_decode + stats.num_waiting == 0
        assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_total_blocks
    # Freed, not finished: far fewer than 1000 tokens were made.
    pairs = list(zip(after, before, strict=True))
    assert 0 < sum(a.num_generation_tokens - b.num_generation_tokens for a, b in pairs) < 500
    assert sum(a.num_finished - b.num_finished for a, b in pairs) == 1


async def test_a_request_preempted_and_offloaded_behind_smg_streams_every_token(
        tmp_path: Path) -> None:
    """A pool too small for the burst: decodes are preempted, offloaded and
    restored, yet every SSE stream ends normally with all its tokens, the
    same text as the request alone."""
    config = StackConfig(num_blocks=PRESSURED_BLOCKS, preemption_mode="offload",
                         scheduler_args=PRESSURED_SCHEDULER_ARGS)
    prompts = [f"request {i}: kv cache blocks, offload and resume" for i in range(8)]
    with running_stack(config, tmp_path) as stack, \
            running_gateway([stack.address], tmp_path) as gateway:
        body = {"model": "tiny", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        streams = await asyncio.gather(*[
            stream_completion(gateway.url, body | {"prompt": p}) for p in prompts])
        async with Client(stack.address) as client:
            stats = await client.stats()
            alone = [(await client.complete(p, max_tokens=48, ignore_eos=True)).text
                     for p in prompts]
    assert stats.num_preemptions_offload > 0 and stats.bytes_restored > 0, stats
    assert stats.num_recomputed_tokens == 0
    for streamed, text in zip(streams, alone, strict=True):
        assert (streamed.finish_reason, streamed.completion_tokens) == ("length", 48)
        assert streamed.text == text.rstrip(REPLACEMENT)


async def test_a_killed_instance_leaves_smgs_rotation_and_the_other_serves_all(
        tmp_path: Path) -> None:
    with running_stack(StackConfig(num_blocks=64, instances=2), tmp_path) as stack, \
            running_gateway(stack.addresses, tmp_path, health_check_interval_s=1) as gateway:
        dead = stack.more_instances[0].scheduler
        dead.kill()
        deadline = time.monotonic() + 30
        while (health := await asyncio.to_thread(_health, gateway.url))[dead.address] and (
                time.monotonic() < deadline):
            await asyncio.sleep(0.2)
        assert health == {stack.address: True, dead.address: False}
        failed_attempts = gateway.log_path.read_text().count("attempt failed")
        body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        before = (await _settled(stack.address)).num_finished
        replies = [await asyncio.to_thread(request_json, f"{gateway.url}/v1/completions",
                                           body | {"prompt": f"question {i}"})
                   for i in range(6)]
        assert all(r["usage"]["completion_tokens"] == 4 for r in replies)
        assert (await _settled(stack.address)).num_finished == before + 6
        # Not even tried on the dead instance first.
        assert gateway.log_path.read_text().count("attempt failed") == failed_attempts


def _health(url: str) -> dict[str, bool]:
    """smg's view: instance address -> healthy."""
    return {w["url"].removeprefix("grpc://"): w["is_healthy"]
            for w in request_json(f"{url}/workers")["workers"]}


async def test_smg_chats_with_a_checkpoints_own_template(tmp_path: Path) -> None:
    """The worker passes the checkpoint's tokenizer_config.json on; smg
    renders its chat template."""
    model = tmp_path / "tiny-llama"
    model.mkdir()
    write_checkpoint(model, LLAMA, shards=1)
    template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with running_stack(StackConfig(model=str(model), num_blocks=64), tmp_path) as stack, \
            running_gateway([stack.address], tmp_path) as gateway:
        body = {"model": "tiny-llama", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": "hello kv cache"}]}
        reply = await asyncio.to_thread(request_json, f"{gateway.url}/v1/chat/completions",
                                        body)
    # "hello kv cache " is three words of the checkpoint's word-level vocabulary.
    assert reply["usage"] == {**reply["usage"], "prompt_tokens": 3, "completion_tokens": 4}
