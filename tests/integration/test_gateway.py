"""vllm.grpc.engine.VllmEngine on the scheduler's port, called directly and
through the real smg gateway (OpenAI HTTP) on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from kvstash.client import Client
from kvstash.gateway import running_gateway
from kvstash.stack import Stack, StackConfig, running_stack

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
    assert (complete.finish_reason, complete.completion_tokens, list(complete.output_ids)) == (
        "length", 12, [])
    # Not streamed: one complete with every token; text input tokenized here.
    [only] = [r async for r in engine.Generate(pb.GenerateRequest(
        request_id="vllm-once", text="hello kv", sampling_params=greedy(12)))]
    assert list(only.complete.output_ids) == expected


async def test_a_stop_token_is_reported_as_the_matched_stop(
        stack: Stack, engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    tokens = await kvstash_tokens(stack, PROMPT, 6)
    [only] = [r async for r in engine.Generate(pb.GenerateRequest(
        request_id="vllm-stop", tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=greedy(6, stop_token_ids=[tokens[3]])))]
    complete = only.complete
    assert list(complete.output_ids) == tokens[:4]
    assert complete.finish_reason == "stop" and complete.matched_token_id == tokens[3]


async def test_unsupported_requests_say_what_is_not_supported(
        engine: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    cases = {
        "presence_penalty": (greedy(4, presence_penalty=0.5), grpc.StatusCode.UNIMPLEMENTED),
        "stop": (greedy(4, stop=["x"]), grpc.StatusCode.UNIMPLEMENTED),
        "n": (greedy(4, n=3), grpc.StatusCode.UNIMPLEMENTED),
        "top_p": (greedy(4, top_p=2.0), grpc.StatusCode.INVALID_ARGUMENT),
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
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
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
    server = await engine.GetServerInfo(pb.GetServerInfoRequest())
    assert server.block_size == 16 and server.server_type == "vllm-grpc"
    loads = await engine.GetLoads(pb.GetLoadsRequest())
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
def gateway(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """smg in front of the stack's scheduler; its base URL."""
    with running_gateway([stack.address], tmp_path_factory.mktemp("smg")) as gateway:
        yield gateway.url


def post(url: str, body: dict[str, object] | None = None) -> bytes:
    """POSTs `body` as JSON (GET without one)."""
    request = urllib.request.Request(
        url, None if body is None else json.dumps(body).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return bytes(reply.read())


def shown(token_ids: list[int]) -> str:
    """The text smg shows for byte tokens: invalid bytes as U+FFFD, but none
    at the very end (its streaming decoder holds them back for good)."""
    return bytes(token_ids).decode("utf-8", "replace").rstrip("\ufffd")


async def test_smg_lists_the_model_and_completes_as_kvstash_does(
        stack: Stack, gateway: str) -> None:
    models = json.loads(await asyncio.to_thread(post, f"{gateway}/v1/models"))
    assert [m["id"] for m in models["data"]] == ["tiny"]
    expected = await kvstash_tokens(stack, "hello kv", 16)
    body = {"model": "tiny", "prompt": "hello kv", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    reply = json.loads(await asyncio.to_thread(post, f"{gateway}/v1/completions", body))
    [choice] = reply["choices"]
    assert choice["text"] == shown(expected) and choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 16
    streamed = (await asyncio.to_thread(
        post, f"{gateway}/v1/completions", body | {"stream": True})).decode()
    events = [json.loads(line[6:]) for line in streamed.splitlines()
              if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == shown(expected)
    assert streamed.rstrip().endswith("data: [DONE]")


async def test_smg_chat_applies_the_tiny_template(stack: Stack, gateway: str) -> None:
    prompt = "<|user|>\nhi\n<|assistant|>\n"
    expected = await kvstash_tokens(stack, prompt, 8)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    reply = json.loads(await asyncio.to_thread(post, f"{gateway}/v1/chat/completions", body))
    assert reply["usage"]["prompt_tokens"] == len(prompt.encode())
    assert reply["choices"][0]["message"]["content"] == shown(expected)


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
        await asyncio.to_thread(post, f"{url}/v1/completions", body | {"prompt": prefix + "q0"})
        await asyncio.sleep(1.0)  # its blocks' events reach smg
        for i in range(1, 5):
            await asyncio.to_thread(post, f"{url}/v1/completions",
                                    body | {"prompt": prefix + f"q{i}"})
        hits = []
        for instance in (a, b):
            async with Client(instance.address) as client:
                hits.append((await client.stats()).num_prefix_hit_tokens)
    full_blocks = len(prefix.encode()) // 16 * 16
    assert sorted(hits)[0] == 0, hits  # the other instance never saw the prefix
    assert max(hits) >= 4 * full_blocks, hits
