"""A long text prompt is encoded without stopping the event loop: every other
stream and the step loop go on (a 3 MB text held the loop 1.7 s: the Hugging
Face tokenizer's encode() keeps the GIL, its encode_batch() lets it go), and
to the ids vLLM encodes it to (a Llama tokenizer's BOS first)."""

from __future__ import annotations

import asyncio
import time

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

from kvstash.common.tokenizer import (
    INLINE_ENCODE_CHARS,
    ByteTokenizer,
    byte_tokenizer_json,
    encode_text,
    load_tokenizer,
)


async def test_a_long_text_is_encoded_while_the_loop_goes_on() -> None:
    tokenizer = load_tokenizer(byte_tokenizer_json(), 258, (257,))
    text = "The quick brown fox. " * 150_000  # 3.1 MB
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    started = time.perf_counter()
    ids = await encode_text(tokenizer, text)
    took = time.perf_counter() - started
    ticker.cancel()
    assert ids == ByteTokenizer().encode(text)  # the byte tokenizer's ids: its bytes
    # The loop ticked on while the encode ran (it took ~1 s here).
    assert max(gaps) < max(0.25, took / 3), (max(gaps), took)


async def test_short_texts_are_encoded_inline_alike() -> None:
    tokenizer = load_tokenizer(byte_tokenizer_json(), 258, (257,))
    for text in ("", "héllo </s>", "x" * INLINE_ENCODE_CHARS):
        assert await encode_text(tokenizer, text) == tokenizer.encode(text)


def llama_style_tokenizer_json() -> str:
    """A word-level tokenizer.json with a Llama checkpoint's post-processor:
    a TemplateProcessing that puts BOS ("<s>", id 1) before a text."""
    words = ["<unk>", "<s>", "</s>", "kv", "cache", "world"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>")])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return str(tokenizer.to_str())


async def test_a_text_prompt_gets_the_bos_a_llama_tokenizer_adds_as_in_vllm() -> None:
    """vLLM encodes a text prompt with the tokenizer's defaults
    (transformers' encode, add_special_tokens=True): a Llama tokenizer's BOS
    comes first. kvstash encoded it without, so the same text got other ids,
    other outputs, and one prompt token fewer in usage."""
    from transformers import PreTrainedTokenizerFast  # slow to import: only here

    tokenizer_json = llama_style_tokenizer_json()
    vllm_ids = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json)).encode
    tokenizer = load_tokenizer(tokenizer_json, 6, (2,))
    long_text = "kv cache " * (INLINE_ENCODE_CHARS // 9 + 1)  # encoded on a thread
    for text in ("kv cache", long_text):
        assert await encode_text(tokenizer, text) == vllm_ids(text)
    assert tokenizer.encode("kv cache") == [1, 3, 4]
