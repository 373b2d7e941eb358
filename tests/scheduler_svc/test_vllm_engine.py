"""VllmEngine's sampling parameters, field by field, and its tokenizer files."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from tokenizers import Tokenizer as HFTokenizer

from kvstash.common.sampling import Room, SamplingParams
from kvstash.common.tokenizer import (
    BYTE_BOS_ID,
    BYTE_EOS_ID,
    ByteTokenizer,
    Tokenizer,
    byte_tokenizer_json,
    load_tokenizer,
    tokenizer_files,
)
from kvstash.errors import InvalidArgument
from scheduler_svc.backend import Timing
from scheduler_svc.core.outputs import RequestUpdate
from scheduler_svc.vllm_engine import _Sequence
from scheduler_svc.vllm_info import tokenizer_zip
from scheduler_svc.vllm_sampling import StopStrings, children, sampling_from_vllm, stop_strings

MAX_MODEL_LEN = 512


def mapped(**fields: object) -> SamplingParams:
    return sampling_from_vllm(pb.SamplingParams(**fields),  # type: ignore[arg-type]
                              Room(10, MAX_MODEL_LEN))


def test_what_smg_sends_by_default_is_the_vllm_default() -> None:
    # smg's request for {"prompt": ..., "max_tokens": 32} (logged from smg 1.13.0).
    sampling = mapped(top_p=1.0, repetition_penalty=1.0, max_tokens=32, skip_special_tokens=True,
                      spaces_between_special_tokens=True, n=1)
    assert sampling == SamplingParams(max_tokens=32, temperature=1.0)


@pytest.mark.parametrize(("fields", "expected"), [
    ({"temperature": 0.0}, {"temperature": 0.0}),
    ({"temperature": 0.7}, {"temperature": pytest.approx(0.7)}),
    ({"top_p": 0.9}, {"top_p": pytest.approx(0.9)}),
    ({"top_p": 0.0}, {"top_p": 1.0}),  # proto3 zero: unset
    ({"top_k": 40}, {"top_k": 40}),
    ({"max_tokens": 7}, {"max_tokens": 7}),
    ({}, {"max_tokens": MAX_MODEL_LEN - 10}),  # unset: to the end of the context
    ({"seed": 42}, {"seed": 42}),
    ({"seed": -1}, {"seed": None}),  # vLLM's "no seed"
    ({"seed": -7}, {"seed": 2**64 - 7}),  # other negative seeds: as uint64
    ({"seed": -2**31}, {"seed": 2**64 - 2**31}),
    ({"max_tokens": MAX_MODEL_LEN - 10}, {"max_tokens": MAX_MODEL_LEN - 10}),  # all the room
    ({"stop_token_ids": [7, 9]}, {"stop_token_ids": (7, 9)}),
    ({"ignore_eos": True}, {"ignore_eos": True}),
    ({"n": 1}, {}),
    ({"repetition_penalty": 1.0}, {}),
    ({"skip_special_tokens": True, "spaces_between_special_tokens": True}, {}),
])
def test_each_supported_field_maps(fields: dict[str, object], expected: dict[str, object]) -> None:
    # {}: max_tokens left unset.
    sampling = mapped(**({"temperature": 0.5, "max_tokens": 16} | fields if fields
                         else {"temperature": 0.5}))
    defaults = {"temperature": 0.5, "max_tokens": 16, "top_p": 1.0, "top_k": 0, "seed": None,
                "stop_token_ids": (), "ignore_eos": False}
    for name, value in {**defaults, **expected}.items():
        assert getattr(sampling, name) == value, name


@pytest.mark.parametrize("fields", [
    {"min_p": 0.05}, {"frequency_penalty": 0.2}, {"presence_penalty": 0.1},
    {"repetition_penalty": 1.1}, {"min_tokens": 2}, {"logprobs": 2},
    {"prompt_logprobs": 1}, {"truncate_prompt_tokens": 8}, {"logit_bias": {5: 1.0}},
    {"json_object": True}, {"regex": "a+"},
], ids=lambda f: next(iter(f)))
def test_each_unsupported_field_is_invalid_argument_by_name(fields: dict[str, object]) -> None:
    # Before: Unimplemented, which smg answers HTTP 501 and OpenAI clients retry.
    with pytest.raises(InvalidArgument, match=next(iter(fields)).split("_")[0]) as info:
        mapped(max_tokens=4, **fields)  # type: ignore[arg-type]
    assert "accepts max_tokens, temperature, top_p, top_k, seed, n, stop" in str(info.value)


def cut(stops: list[str], pieces: list[str]) -> tuple[list[int], str | None]:
    """StopStrings over the byte tokenizer: `pieces` arrive one update each."""
    watch = StopStrings(stops, ByteTokenizer().stream())
    sent: list[int] = []
    for piece in pieces:
        kept, matched = watch.cut(list(piece.encode()))
        sent += kept
        if matched is not None:
            return sent, matched
    return sent, None


def test_a_stop_string_cuts_after_the_token_that_completes_it() -> None:
    assert cut(["kv"], ["a k", "v b"]) == (list(b"a kv"), "kv")  # across updates
    assert cut(["cache", "b"], ["a b cache"]) == (list(b"a b"), "b")  # the first to match
    assert cut(["zz", "ab"], ["xab"]) == (list(b"xab"), "ab")
    assert cut(["é"], ["caf", "é!"]) == (list("café".encode()), "é")  # two tokens, one char
    assert cut(["stop"], ["sto", "p"]) == (list(b"stop"), "stop")
    assert cut(["never"], ["neve", "r-", "mind"]) == (list(b"never"), "never")  # "-" not sent
    assert cut(["abc"], ["ab", "xc", "abc"]) == (list(b"abxcabc"), "abc")
    assert cut(["q"], ["no match here"]) == (list(b"no match here"), None)


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), load_tokenizer(
    byte_tokenizer_json(), 258, (BYTE_EOS_ID,))], ids=["bytes", "tokenizer.json"])
@pytest.mark.parametrize("skip", [True, False])
def test_a_stop_string_matches_a_special_tokens_text_unless_it_is_skipped(
        tokenizer: Tokenizer, skip: bool) -> None:
    """As vLLM matches stop strings in the text it detokenizes with the
    request's skip_special_tokens: "<s>" (BOS) stops a sequence only where
    its text is kept. Before, it was skipped whatever the request said."""
    watch = StopStrings(["<s>"], tokenizer.stream(skip_special_tokens=skip))
    got = watch.cut([104, BYTE_BOS_ID, 105])  # "h", "<s>", "i"
    assert got == (([104, BYTE_BOS_ID, 105], None) if skip else ([104, BYTE_BOS_ID], "<s>"))


class Released:
    """What a sequence's `take` asks of the backend at a stop string."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str, reported_as: object = None) -> None:
        self.aborted.append(request_id)


@pytest.mark.parametrize("keep", [True, False])
def test_a_sequence_matches_stop_strings_as_its_request_says_of_special_tokens(
        keep: bool) -> None:
    params = pb.SamplingParams(stop=["<s>"], skip_special_tokens=not keep, max_tokens=8)
    seq = _Sequence("r", Timing(0.0), mapped(stop=["<s>"], max_tokens=8), stop_strings(params),
                    ByteTokenizer(), keep_special_text=keep)
    backend = Released()
    sent = seq.take(RequestUpdate("r", [104, BYTE_BOS_ID, 105]), backend)  # type: ignore[arg-type]
    assert (sent, seq.matched, backend.aborted) == (
        ([104, BYTE_BOS_ID], "<s>", ["r"]) if keep else ([104, BYTE_BOS_ID, 105], None, []))


@pytest.mark.parametrize(("stop", "message"), [
    ([""], "1 to 1024 characters, got 0"), (["x" * 1025], "got 1025"),
    (["s"] * 33, "has 33 strings, at most 32"),
])
def test_bad_stop_strings_are_invalid_arguments(stop: list[str], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        stop_strings(pb.SamplingParams(stop=stop))
    assert stop_strings(pb.SamplingParams(stop=["a", "\n\n"])) == ["a", "\n\n"]


def test_n_sequences_get_their_own_ids_and_seeds() -> None:
    seeded = SamplingParams(max_tokens=4, temperature=0.8, seed=7)
    assert children("r", 0, seeded) == children("r", 1, seeded) == [("r", seeded)]
    three = children("r", 3, seeded)
    assert [i for i, _ in three] == ["r:0", "r:1", "r:2"]
    assert [s.seed for _, s in three] == [7, 8, 9]  # as vLLM seeds them
    assert all(s.temperature == 0.8 for _, s in three)
    unseeded = SamplingParams(max_tokens=4)
    assert [s.seed for _, s in children("r", 2, unseeded)] == [None, None]
    # A negative seed's children, as vLLM seeds them (seed + index), as uint64.
    wrapping = mapped(max_tokens=4, seed=-2)
    assert [s.seed for _, s in children("r", 3, wrapping)] == [2**64 - 2, 2**64 - 1, 0]
    with pytest.raises(InvalidArgument, match="n 17: at most 16"):
        children("r", 17, seeded)
    with pytest.raises(InvalidArgument, match="request_id must be"):
        children("x" * 255, 2, seeded)  # "x...x:1" is too long


@pytest.mark.parametrize("num_prompt_tokens", [MAX_MODEL_LEN, MAX_MODEL_LEN + 1])
def test_a_prompt_that_leaves_no_room_names_both_lengths(num_prompt_tokens: int) -> None:
    # Before: "max_tokens must be positive, got 0" (unset) or a clamp to nothing.
    for fields in ({}, {"max_tokens": 4}):
        with pytest.raises(InvalidArgument,
                           match=f"prompt of {num_prompt_tokens} tokens .*{MAX_MODEL_LEN}"):
            sampling_from_vllm(pb.SamplingParams(**fields),  # type: ignore[arg-type]
                               Room(num_prompt_tokens, MAX_MODEL_LEN))
    last = Room(MAX_MODEL_LEN - 1, MAX_MODEL_LEN)
    assert sampling_from_vllm(pb.SamplingParams(max_tokens=1), last).max_tokens == 1
    assert sampling_from_vllm(pb.SamplingParams(), last).max_tokens == 1


@pytest.mark.parametrize("max_tokens", [MAX_MODEL_LEN - 9, MAX_MODEL_LEN, 2**32 - 1])
def test_a_max_tokens_that_does_not_fit_is_refused_never_cut(max_tokens: int) -> None:
    # Before: cut to the room left (here 502), unlike kvstash.v1, which refused it.
    with pytest.raises(InvalidArgument, match=(
            f"max_tokens {max_tokens} does not fit: a prompt of 10 tokens leaves room for "
            f"at most {MAX_MODEL_LEN - 10}")):
        mapped(max_tokens=max_tokens)


@pytest.mark.parametrize("fields", [{"temperature": -1.0}, {"top_p": 1.5}, {"max_tokens": 0}])
def test_bad_values_are_invalid_arguments(fields: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        mapped(**{"max_tokens": 4, **fields})  # type: ignore[arg-type]


def test_the_tiny_models_tokenizer_files_load_and_encode_bytes() -> None:
    files = tokenizer_files("", "", (257,))
    with zipfile.ZipFile(io.BytesIO(tokenizer_zip(files))) as archive:
        assert sorted(archive.namelist()) == ["config.json", "tokenizer.json",
                                              "tokenizer_config.json"]
        tokenizer = HFTokenizer.from_str(archive.read("tokenizer.json").decode())
        config = json.loads(archive.read("tokenizer_config.json"))
        assert json.loads(archive.read("config.json")) == {"eos_token_id": [257]}
    assert tokenizer.encode("héllo").ids == list("héllo".encode())
    assert config["eos_token"] == "</s>" and "add_generation_prompt" in config["chat_template"]


def test_a_checkpoints_tokenizer_is_passed_on_as_it_is() -> None:
    config = '{"chat_template": "{{ messages[0].content }}", "eos_token": "<e>"}'
    files = tokenizer_files('{"version": "1.0"}', config, (2, 3))
    assert files["tokenizer.json"] == '{"version": "1.0"}'
    assert files["tokenizer_config.json"] == config
    assert json.loads(files["config.json"]) == {"eos_token_id": [2, 3]}
    # A checkpoint without a tokenizer_config.json: a minimal one, no template.
    bare = json.loads(tokenizer_files('{"version": "1.0"}', "", (2,))["tokenizer_config.json"])
    assert "chat_template" not in bare
