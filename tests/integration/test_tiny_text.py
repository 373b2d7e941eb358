"""The tiny model's text as clients and load tools see it, on a real stack.

A load tool (aiperf, guidellm) counts a reply's tokens by re-tokenizing its
text with the files `kvstash tokenizer export` writes: that count must be the
server's `completion_tokens`, and the text must hold no control character or
U+FFFD; `kvstash generate` prints it unchanged; and the exported files
tokenize as the server does."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import transformers

from kvstash.client import Client
from kvstash.launch.gateway import running_gateway
from kvstash.launch.openai_http import request_json
from kvstash.launch.stack import Stack
from kvstash.launch.tokenizer_export import builtin_tokenizer_files

PROMPTS = ["hello kv", "héllo 🙂 日本語", "\x1b[2J\x07\x7f"]
# Greedy, then hot sampling: a random model's widest spread of tokens.
SAMPLINGS = [{"temperature": 0.0}, *({"temperature": 1.5, "seed": s} for s in range(5))]


def kvstash_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstash.launch.cli", *args],
                          check=False, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def exported(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stack's tokenizer, written by `kvstash tokenizer export --address`."""
    directory = tmp_path_factory.mktemp("exported") / "tiny"
    done = kvstash_cli("tokenizer", "export", str(directory), "--address", stack.address)
    assert done.returncode == 0, done.stderr
    return directory


def check_round_trip(tokenizer: object, text: str, completion_tokens: int) -> None:
    assert len(tokenizer(text).input_ids) == completion_tokens, text  # type: ignore[operator]
    assert "\ufffd" not in text
    assert not [c for c in text if unicodedata.category(c) == "Cc"], text


async def test_outputs_re_tokenize_to_exactly_their_completion_tokens(
        stack: Stack, exported: Path) -> None:
    """Ended by length, the text is every token; ended by EOS, every token but
    the EOS, which counts in completion_tokens (as in vLLM) and has no text."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    async with Client(stack.address) as client:
        results = await asyncio.gather(*[
            client.complete(prompt, max_tokens=64, **sampling)  # type: ignore[arg-type]
            for prompt in PROMPTS for sampling in SAMPLINGS])
    for result in results:
        assert result.usage is not None
        eos = [tokenizer.eos_token_id] if result.finish_reason == "stop" else []
        assert result.token_ids[len(result.token_ids) - len(eos):] == eos
        check_round_trip(tokenizer, result.text, result.usage.completion_tokens - len(eos))
        assert tokenizer.decode(result.token_ids, skip_special_tokens=True) == result.text
    finishes = [r.finish_reason for r in results]
    assert finishes.count("length") >= len(finishes) // 2 and "stop" in finishes


async def test_with_ignore_eos_only_the_eos_tokens_have_no_text(
        stack: Stack, exported: Path) -> None:
    """A load tool's fixed-length requests: EOS may come and go on, as in vLLM."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    async with Client(stack.address) as client:
        results = await asyncio.gather(*[
            client.complete("hello kv", max_tokens=64, ignore_eos=True, temperature=1.5,
                            seed=seed) for seed in range(8)])
    for result in results:
        assert result.usage is not None and result.usage.completion_tokens == 64
        num_eos = result.token_ids.count(tokenizer.eos_token_id)
        check_round_trip(tokenizer, result.text, 64 - num_eos)


async def test_through_smg_the_usage_is_what_the_text_re_tokenizes_to(
        stack: Stack, exported: Path, tmp_path: Path) -> None:
    """What aiperf did: OpenAI completions through smg, counted from the text."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    with running_gateway([stack.address], tmp_path) as gateway:
        replies = await asyncio.gather(*[asyncio.to_thread(
            request_json, f"{gateway.url}/v1/completions",
            {"model": "tiny", "prompt": "hello kv", "max_tokens": 64, "temperature": 1.5,
             "seed": seed}) for seed in range(6)])
    for reply in replies:
        [choice] = reply["choices"]
        num_eos = choice["finish_reason"] == "stop"  # the EOS: counted, no text
        check_round_trip(tokenizer, choice["text"], reply["usage"]["completion_tokens"] - num_eos)


async def test_generate_prints_the_text_as_the_server_made_it(stack: Stack) -> None:
    async with Client(stack.address) as client:
        expected = await client.complete("hello kv", max_tokens=48, temperature=1.5, seed=3)
    done = await asyncio.to_thread(kvstash_cli, "generate", "hello kv", "--address",
                                   stack.address, "--max-tokens", "48", "--temperature", "1.5",
                                   "--seed", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.text  # the usage line goes to stderr
    assert expected.usage is not None
    assert f"{expected.usage.completion_tokens} completion tokens" in done.stderr


def test_export_from_a_stack_is_the_builtin(exported: Path, tmp_path: Path) -> None:
    done = kvstash_cli("tokenizer", "export", str(tmp_path / "builtin"))
    assert done.returncode == 0, done.stderr
    written = {p.name: p.read_bytes() for p in exported.iterdir()}
    assert written == {p.name: p.read_bytes() for p in (tmp_path / "builtin").iterdir()}
    assert written == builtin_tokenizer_files()


async def test_the_exported_tokenizer_tokenizes_as_the_server(
        stack: Stack, exported: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    async with Client(stack.address) as client:
        for text in ["hello kv", "héllo 🙂 日本語", "  spaces\n\ttab", "<|user|>\nhi\n"]:
            ids = tokenizer(text).input_ids
            by_text = await client.complete(text, max_tokens=8)
            by_ids = await client.complete(ids, max_tokens=8)
            assert by_text.usage is not None and by_ids.usage is not None
            assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)
            assert by_text.token_ids == by_ids.token_ids
            assert tokenizer.decode(ids) == text
