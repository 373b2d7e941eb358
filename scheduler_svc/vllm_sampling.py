"""VllmEngine's sampling: `vllm.grpc.engine.SamplingParams` mapped field by
field onto kvstash's, the n sequences of a request, and stop strings, which
the scheduler matches on the text of the tokens as they come (the core sees
tokens only)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from smg_grpc_proto import vllm_engine_pb2 as pb

from kvstash import errors
from kvstash.common.ids import check_request_id
from kvstash.common.sampling import MAX_SEED, SamplingParams
from kvstash.common.tokenizer import TextStream

# SamplingParams fields kvstash has no counterpart for, with their neutral value.
# (include_stop_str_in_output shapes the text, which the gateway makes.)
_UNSUPPORTED_SAMPLING = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_tokens": 0,
    "grammar_from_first_token": False,
}
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


def sampling_from_vllm(params: pb.SamplingParams, num_prompt_tokens: int,
                       max_len: int) -> SamplingParams:
    """kvstash's sampling for a VllmEngine request whose sequence may reach
    `max_len` tokens; Unimplemented names a field it cannot honour,
    InvalidArgument a bad value.

    As vLLM: max_tokens (unset: no limit) is cut to the room the prompt
    leaves below max_len, where the sequence then ends "length"; only a
    prompt that leaves none is refused."""
    for name, neutral in _UNSUPPORTED_SAMPLING.items():
        if getattr(params, name) != neutral:
            raise errors.Unimplemented(f"sampling_params.{name} is not supported")
    if params.repetition_penalty not in (0.0, 1.0):
        raise errors.Unimplemented("sampling_params.repetition_penalty is not supported")
    for name in ("logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
        if params.HasField(name):
            raise errors.Unimplemented(f"sampling_params.{name} is not supported")
    if params.logit_bias:
        raise errors.Unimplemented("sampling_params.logit_bias is not supported")
    if params.WhichOneof("constraint") is not None:
        raise errors.Unimplemented(
            f"sampling_params.{params.WhichOneof('constraint')} (constrained decoding) "
            "is not supported")
    room = max_len - num_prompt_tokens
    if room < 1:
        raise errors.InvalidArgument(
            f"prompt of {num_prompt_tokens} tokens leaves no room to generate: sequences "
            f"here are at most {max_len} tokens (max_model_len, or what the KV pool holds)")
    return SamplingParams(
        max_tokens=min(params.max_tokens, room) if params.HasField("max_tokens") else room,
        # Unset: vLLM's (and OpenAI's) default of 1.0; 0 is greedy.
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        seed=_seed(params),
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )


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
