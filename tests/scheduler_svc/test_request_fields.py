"""One rule per request field on both APIs, kvstash.v1 Scheduler and
VllmEngine, over a real channel, in process; and VllmEngine's answer to the
fields kvstash cannot honour.

A pool of 16 blocks of 4 holds 64 tokens, fewer than max_model_len 256: a
prompt of 3 tokens leaves room for 61. The engine is attached but never
started: a request either waits in the core, its sampling as admitted, or
is refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from kvstash.common import rpc_connections
from kvstash.common.sampling import SamplingParams
from kvstash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.serving import create_scheduler_server
from tests.scheduler_svc.factories import make_scheduler
from tests.scheduler_svc.test_server import attach, queued, rpc_error, vllm_generate

PROMPT = [1, 2, 3]
ROOM = 61  # what PROMPT leaves of the 64 tokens the pool holds
APIS = ["kvstash.v1", "VllmEngine"]


@dataclass(slots=True)
class Served:
    channel: grpc.aio.Channel
    core: Scheduler

    def generate(self, api: str, request_id: str, prompt: list[int],
                 **sampling: object) -> grpc.aio.UnaryStreamCall:
        """A Generate on `api`, with only the sampling fields given set."""
        if api == "VllmEngine":
            return vllm_engine_pb2_grpc.VllmEngineStub(self.channel).Generate(
                vllm_generate(request_id, prompt, **sampling))
        return scheduler_pb2_grpc.SchedulerStub(self.channel).Generate(
            scheduler_pb2.GenerateRequest(
                request_id=request_id, token_ids=scheduler_pb2.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(**sampling)))  # type: ignore[arg-type]

    async def admitted(self, api: str, request_id: str, **sampling: object) -> SamplingParams:
        """The sampling a request of PROMPT is admitted with; the request is
        then cancelled, and gone."""
        call = self.generate(api, request_id, PROMPT, **sampling)
        await queued(self.core, request_id)
        request = self.core.get_request(request_id)
        assert request is not None
        call.cancel()
        async with asyncio.timeout(10):
            while self.core.get_request(request_id) is not None:
                await asyncio.sleep(0.01)
        return request.sampling

    async def refusal(self, api: str, request_id: str, prompt: list[int] = PROMPT,
                      **sampling: object) -> str:
        """The details of an INVALID_ARGUMENT; nothing was admitted."""
        error = await rpc_error(self.generate(api, request_id, prompt, **sampling))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert self.core.get_request(request_id) is None
        return error.details() or ""


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    server = await create_scheduler_server("127.0.0.1:0")
    async with grpc.aio.insecure_channel("127.0.0.1:1") as nowhere, \
            rpc_connections.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        core = make_scheduler(vocab_size=258, num_blocks=16, max_model_len=256)
        attach(server, nowhere, core)
        yield Served(channel, core)
    await server.server.stop(None)


@pytest.mark.parametrize("api", APIS)
async def test_max_tokens_unset_runs_until_the_context_ends(served: Served, api: str) -> None:
    # Before, on kvstash.v1: "max_tokens must be positive, got 0" (none was sent).
    assert (await served.admitted(api, "unset")).max_tokens == ROOM
    assert (await served.admitted(api, "all", max_tokens=ROOM)).max_tokens == ROOM
    assert (await served.admitted(api, "some", max_tokens=5)).max_tokens == 5


@pytest.mark.parametrize("api", APIS)
async def test_max_tokens_zero_or_past_the_context_is_refused(served: Served, api: str) -> None:
    # Before, on VllmEngine: zero was refused but past the context was cut to ROOM.
    assert "max_tokens must be positive, got 0" in await served.refusal(
        api, "zero", max_tokens=0)
    for max_tokens in (ROOM + 1, 1000, 2**32 - 1):
        details = await served.refusal(api, f"past-{max_tokens}", max_tokens=max_tokens)
        assert (f"max_tokens {max_tokens} does not fit: a prompt of 3 tokens leaves room "
                f"for at most {ROOM} (sequences here are at most 64 tokens: max_model_len, or what "
                "the KV pool holds)") in details
    for fields in ({}, {"max_tokens": 4}):  # a prompt that leaves no room, either way
        details = await served.refusal(api, "no-room", [1] * 70, **fields)
        assert "prompt of 70 tokens leaves no room" in details and "64" in details


@pytest.mark.parametrize("api", APIS)
async def test_temperature_unset_is_one_as_openai_and_zero_is_greedy(
        served: Served, api: str) -> None:
    # Before, on kvstash.v1: unset was greedy (proto3 read it as 0).
    assert (await served.admitted(api, "unset", max_tokens=4)).temperature == 1.0
    assert (await served.admitted(api, "zero", max_tokens=4, temperature=0.0)).greedy
    refused = await served.refusal(api, "negative", max_tokens=4, temperature=-1.0)
    assert "temperature must be finite and >= 0, got -1.0" in refused


async def test_vllm_engine_advertises_the_context_the_rule_uses(served: Served) -> None:
    engine = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
    info = await engine.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
    assert (info.max_context_length, info.max_req_input_len) == (64, 63)


# Each field set as an OpenAI request through smg sets it (presence_penalty,
# chat logprobs, response_format, min_tokens, ...), and the rest of vLLM's.
UNSUPPORTED = [
    ("presence_penalty", {"presence_penalty": 0.5}),
    ("frequency_penalty", {"frequency_penalty": -0.5}),
    ("repetition_penalty", {"repetition_penalty": 1.2}),
    ("min_p", {"min_p": 0.1}),
    ("min_tokens", {"min_tokens": 3}),
    ("logprobs", {"logprobs": 0}),  # chat's logprobs: true, no top_logprobs
    ("logprobs", {"logprobs": 2}),
    ("prompt_logprobs", {"prompt_logprobs": 1}),
    ("logit_bias", {"logit_bias": {5: 1.0}}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 2}),
    ("grammar_from_first_token", {"grammar_from_first_token": True}),
    ("json_object", {"json_object": True}),  # response_format json_object
    ("json_schema", {"json_schema": '{"type": "object"}'}),
    ("regex", {"regex": "a+"}),
    ("grammar", {"grammar": "root ::= \"a\""}),
    ("structural_tag", {"structural_tag": "{}"}),
    ("choice", {"choice": vllm_engine_pb2.ChoiceConstraint(choices=["a", "b"])}),
]


@pytest.mark.parametrize(("name", "fields"), UNSUPPORTED, ids=[n for n, _ in UNSUPPORTED])
async def test_an_unsupported_field_is_invalid_argument_naming_it_and_what_is_accepted(
        served: Served, name: str, fields: dict[str, object]) -> None:
    # Before: UNIMPLEMENTED, which smg answers HTTP 501 "server_error", so the
    # openai SDK retried twice and raised InternalServerError.
    details = await served.refusal("VllmEngine", "unsupported", max_tokens=4, **fields)
    assert f"sampling_params.{name} " in details
    assert ("accepts max_tokens, temperature, top_p, top_k, seed, n, stop, stop_token_ids, "
            "ignore_eos") in details


async def test_multimodal_input_is_invalid_argument(served: Served) -> None:
    request = vllm_generate("image", PROMPT, max_tokens=4)
    request.mm_inputs.CopyFrom(vllm_engine_pb2.MultimodalInputs(mm_hashes=["x"]))
    call = vllm_engine_pb2_grpc.VllmEngineStub(served.channel).Generate(request)
    error = await rpc_error(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "multimodal inputs are not supported" in (error.details() or "")


async def test_a_priority_is_refused_not_ignored(served: Served) -> None:
    """kvstash.v1's priority has no scheduling behind it: one set used to be
    accepted and served first come, first served, as if it were 0."""
    call = scheduler_pb2_grpc.SchedulerStub(served.channel).Generate(
        scheduler_pb2.GenerateRequest(
            request_id="urgent", token_ids=scheduler_pb2.TokenIds(ids=PROMPT), priority=5,
            sampling=common_pb2.SamplingParams(max_tokens=4)))
    async with asyncio.timeout(10):  # before: queued, to run first come, first served
        error = await rpc_error(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "priority 5 is not supported" in (error.details() or "")
    assert served.core.get_request("urgent") is None
    assert (await served.admitted("kvstash.v1", "default", max_tokens=4)).max_tokens == 4
