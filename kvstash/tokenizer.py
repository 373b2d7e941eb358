"""Tokenizers the scheduler and the worker agree on, without torch.

Two kinds: the byte-level tokenizer of the built-in tiny model (ids 0-255 are
bytes, then BOS and EOS), and a Hugging Face `tokenizer.json`. The worker
publishes which one it uses in `WorkerInfo.tokenizer_json` (empty = bytes), so
the scheduler needs no model files of its own.

Decoding is incremental: a `TextStream` turns token ids into text as they
arrive and holds back bytes until they form complete UTF-8 characters.
"""

from __future__ import annotations

import codecs
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_VOCAB_SIZE = 258


class TextStream(Protocol):
    def push(self, token_id: int) -> str:
        """Text completed by this token (often "")."""
        ...


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def stream(self) -> TextStream: ...


class _ByteStream:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id >= 256:  # special tokens have no text
            return ""
        return self._utf8.decode(bytes([token_id]))


class ByteTokenizer:
    """UTF-8 bytes as tokens; no BOS is added (prompts stay what users sent)."""

    vocab_size: int = BYTE_VOCAB_SIZE
    eos_token_ids: tuple[int, ...] = (BYTE_EOS_ID,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def stream(self) -> TextStream:
        return _ByteStream()


class _HFStream:
    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""


class HFTokenizerAdapter:
    """A Hugging Face `tokenizer.json`, as Llama and Qwen2 checkpoints ship it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer = HFTokenizer.from_str(tokenizer_json)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def stream(self) -> TextStream:
        return _HFStream(self._tokenizer)


def load_tokenizer(
    tokenizer_json: bytes | str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> Tokenizer:
    """The tokenizer a worker described; empty `tokenizer_json` = byte-level."""
    if not tokenizer_json:
        return ByteTokenizer()
    text = tokenizer_json.decode() if isinstance(tokenizer_json, bytes) else tokenizer_json
    return HFTokenizerAdapter(text, vocab_size, eos_token_ids)
