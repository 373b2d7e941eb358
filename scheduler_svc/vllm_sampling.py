"""VllmEngine's sampling: `vllm.grpc.engine.SamplingParams` mapped field by
field onto kvstash's, the n sequences of a request, and stop strings, which
the scheduler matches on the text of the tokens as they come (the core sees
tokens only).

A field kvstash cannot honour is the client's request, not a server fault:
INVALID_ARGUMENT naming it and what is accepted (a gateway answers HTTP
400, which OpenAI clients do not retry), never silently ignored."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from smg_grpc_proto import vllm_engine_pb2 as pb

from kvstash import errors
from kvstash.common.ids import check_request_id
from kvstash.common.sampling import DEFAULT_TEMPERATURE, MAX_SEED, Room, SamplingParams
from kvstash.common.tokenizer import TextStream

# SamplingParams fields kvstash has no counterpart for, with their neutral value.
# (include_stop_str_in_output, skip_special_tokens and
# spaces_between_special_tokens shape the text, which the gateway makes;
# skip_special_tokens also says whether stop strings may match a special
# token's text, as in vLLM: vllm_engine.)
_UNSUPPORTED_SAMPLING = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_tokens": 0,
    "grammar_from_first_token": False,
}
# Those only their presence tells apart from the default.
_UNSUPPORTED_OPTIONAL = ("logprobs", "prompt_logprobs", "truncate_prompt_tokens")
# What an error about an unsupported field lists.
ACCEPTED = ("max_tokens, temperature, top_p, top_k, seed, n, stop, stop_token_ids, "
            "ignore_eos")
MAX_STOP_STRINGS = 32
MAX_N = 16  # sequences per request
MAX_STOP_STRING_CHARS = 1024
_VLLM_NO_SEED = -1
_NUM_SEEDS = MAX_SEED + 1  # kvstash's seeds are uint64


class StopStrings:
    """Watches a request's text for stop strings, one token at a time."""

    def __init__(self, stops: Sequence[str], text: TextStream) -> None:
        self._stops = stops
        self._text = text
        self._keep = max(map(len, stops)) - 1  # a match may start this far back
        self._tail = ""

    def cut(self, token_ids: list[int]) -> tuple[list[int], str | None]:
        """The tokens up to the one whose text completes a stop string, and
        that string (the first in request order); all of them and None
        while none has matched."""
        for i, token_id in enumerate(token_ids):
            text = self._tail + self._text.push(token_id)
            for stop in self._stops:
                if stop in text:
                    return token_ids[:i + 1], stop
            self._tail = text[-self._keep:] if self._keep else ""
        return token_ids, None


def stop_strings(params: pb.SamplingParams) -> list[str]:
    """The request's stop strings, checked (InvalidArgument)."""
    stops = list(params.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise errors.InvalidArgument(
            f"sampling_params.stop has {len(stops)} strings, at most {MAX_STOP_STRINGS}")
    for stop in stops:
        if not 0 < len(stop) <= MAX_STOP_STRING_CHARS:
            raise errors.InvalidArgument(
                f"sampling_params.stop strings must have 1 to {MAX_STOP_STRING_CHARS} "
                f"characters, got {len(stop)}")
    return stops


def sampling_from_vllm(params: pb.SamplingParams, room: Room) -> SamplingParams:
    """kvstash's sampling for a VllmEngine request whose sequence must fit
    `room`; InvalidArgument names a field it cannot honour or a bad value.

    max_tokens as kvstash.v1 takes it (Room.max_tokens): unset, until the
    context ends; one that does not fit is refused, as vLLM's OpenAI server
    refuses it. temperature unset: 1.0, as vLLM's (and OpenAI's) default."""
    check_supported(params)
    return SamplingParams(
        max_tokens=room.max_tokens(params.max_tokens if params.HasField("max_tokens") else None),
        temperature=params.temperature if params.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        seed=_seed(params),
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )


def check_supported(params: pb.SamplingParams) -> None:
    """InvalidArgument naming the first field set that kvstash cannot honour
    (OpenAI's penalties, logprobs, min_tokens, logit_bias, response_format),
    and what it accepts."""
    unsupported = [name for name, neutral in _UNSUPPORTED_SAMPLING.items()
                   if getattr(params, name) != neutral]
    if params.repetition_penalty not in (0.0, 1.0):
        unsupported.append("repetition_penalty")
    unsupported += [name for name in _UNSUPPORTED_OPTIONAL if params.HasField(name)]
    if params.logit_bias:
        unsupported.append("logit_bias")
    constraint = params.WhichOneof("constraint")
    if constraint is not None:
        raise errors.InvalidArgument(
            f"sampling_params.{constraint} is not supported by kvstash (constrained "
            f"decoding: OpenAI's response_format); it accepts {ACCEPTED}")
    if unsupported:
        raise errors.InvalidArgument(
            f"sampling_params.{unsupported[0]} is not supported by kvstash; it accepts "
            f"{ACCEPTED}")


def _seed(params: pb.SamplingParams) -> int | None:
    """vLLM's int32 seed as kvstash's uint64 one: -1 (vLLM's "no seed") or
    unset is None; any other negative seed, which vLLM accepts, is taken mod
    2**64 (its two's complement bits, as torch's manual_seed takes it)."""
    if not params.HasField("seed") or params.seed == _VLLM_NO_SEED:
        return None
    return params.seed % _NUM_SEEDS


def children(request_id: str, n: int, sampling: SamplingParams
             ) -> list[tuple[str, SamplingParams]]:
    """The sequences of a request for `n` of them (0 counts as 1): their
    request ids and sampling (seeds seed + index, mod 2**64)."""
    if n > MAX_N:
        raise errors.InvalidArgument(f"sampling_params.n {n}: at most {MAX_N} sequences")
    if n <= 1:
        return [(request_id, sampling)]
    ids = [f"{request_id}:{i}" for i in range(n)]
    check_request_id(ids[-1])  # the longest
    return [(child_id, sampling if sampling.seed is None
             else dataclasses.replace(sampling, seed=(sampling.seed + i) % _NUM_SEEDS))
            for i, child_id in enumerate(ids)]
