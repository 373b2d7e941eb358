"""vllm.grpc.engine.VllmEngine on the scheduler's port, called directly and
through the real smg gateway (OpenAI HTTP) on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
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
from kvstash.stack import Stack

PROMPT = [104, 101, 108, 108, 111, 32, 107, 118]  # "hello kv"
SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")


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
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()):
            pass
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


# -- through smg --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def gateway(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """smg in front of the stack's scheduler; its base URL."""
    assert SMG is not None, "smg is not installed (pip install kvstash[gateway])"
    port = free_port()
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    # No Hugging Face lookup: the tokenizer comes from GetTokenizer.
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"}
    process = subprocess.Popen(
        [SMG, "launch", "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-port", str(free_port()), "--worker-urls", f"grpc://{stack.address}",
         "--policy", "cache_aware", "--worker-startup-check-interval", "1",
         "--shutdown-grace-period-secs", "1"],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/readiness", timeout=2)
                break
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(15)


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
