"""A long text prompt is encoded without stopping the event loop: every other
stream and the step loop go on (a 3 MB text held the loop 1.7 s: the Hugging
Face tokenizer's encode() keeps the GIL, its encode_batch() lets it go)."""

from __future__ import annotations

import asyncio
import time

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
