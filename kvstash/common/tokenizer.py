"""Tokenizers the scheduler and the worker agree on, without torch.

Two kinds: the byte-level tokenizer of the built-in tiny model, and a Hugging
Face `tokenizer.json`. The worker publishes which one it uses in
`WorkerInfo.tokenizer_json` (empty = bytes), so the scheduler needs no model
files of its own.

The tiny model's ids:

    0 ........... 255 | 256 | 257
    UTF-8 bytes         <s>   </s>    (BOS, EOS; encode adds neither, and reads
                                       them written in the text, as Hugging
                                       Face tokenizers read added tokens)

Prompts may hold any text, but the model writes only `TINY_TEXT_IDS`
(printable ASCII but "<" and ">") and EOS: each of its tokens is one
character that encodes back to that one token, alone or in any sequence, with
this tokenizer and with its Hugging Face files. So a load tool that counts the
output's tokens from its text counts what `usage` says, and the text holds
nothing a terminal would interpret. "<" and ">" are left out because
Hugging Face tokenizers read "<s>" and "</s>" written in text as one token.

For clients that tokenize with Hugging Face tools (a gateway loading
`tokenizer.json` and the `chat_template` of `tokenizer_config.json`), the same
tokenizer is also described in those formats: `byte_tokenizer_json()`,
`byte_tokenizer_config()` and `TINY_CHAT_TEMPLATE`.

Decoding is incremental: a `TextStream` turns token ids into text as they
arrive and holds back bytes until they form complete UTF-8 characters. It
reads them after the prompt's last tokens, as vLLM's detokenizer does: a
token's text can depend on the one before it (the space a word-level or
sentencepiece tokenizer writes before a word is dropped at the start of a
text; a character may begin in the prompt).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
from collections.abc import Sequence
from typing import Protocol

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_VOCAB_SIZE = 258
BYTE_BOS_TOKEN = "<s>"
BYTE_EOS_TOKEN = "</s>"
_SPECIAL_IDS = {BYTE_BOS_TOKEN: BYTE_BOS_ID, BYTE_EOS_TOKEN: BYTE_EOS_ID}
_SPECIAL_TEXT = re.compile("(<s>|</s>)")
# The tokens the tiny model writes besides EOS (see the module docstring).
TINY_TEXT_IDS: tuple[int, ...] = tuple(b for b in range(0x20, 0x7F) if chr(b) not in "<>")

# Plain text, so the byte tokenizer encodes it like any prompt.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TextStream(Protocol):
    def push(self, token_id: int) -> str:
        """Text completed by this token (often "")."""
        ...


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def stream(self, skip_special_tokens: bool = True,
               prompt_ids: Sequence[int] = ()) -> TextStream:
        """Text as tokens come after `prompt_ids`; special tokens' own text
        too unless skipped."""
        ...


# Texts longer than this are encoded on a thread (encode_text): a tokenizer
# takes ~0.5 s a megabyte, which the event loop must not wait out.
INLINE_ENCODE_CHARS = 16384
# The prompt's last tokens a TextStream reads first (their text is not
# sent): enough for a word's space and for a character's first bytes.
PROMPT_CONTEXT_TOKENS = 8


async def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """`tokenizer.encode(text)`, a long text on a thread, so that every other
    stream and the step loop go on meanwhile."""
    if len(text) <= INLINE_ENCODE_CHARS:
        return tokenizer.encode(text)
    return await asyncio.to_thread(tokenizer.encode, text)


_BYTE_SPECIAL_TEXT = {BYTE_BOS_ID: BYTE_BOS_TOKEN, BYTE_EOS_ID: BYTE_EOS_TOKEN}


class _ByteStream:
    def __init__(self, skip_special_tokens: bool, prompt_ids: Sequence[int]) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip_special_tokens = skip_special_tokens
        self._utf8.decode(bytes(t for t in prompt_ids[-PROMPT_CONTEXT_TOKENS:] if t < 256))
        if self._utf8.getstate()[0]:  # the prompt ends inside a character: its bytes
            self._utf8.reset()        # are the prompt's text, not the reply's

    def push(self, token_id: int) -> str:
        if token_id >= 256:
            if self._skip_special_tokens:
                return ""
            return self._utf8.decode(b"", final=True) + _BYTE_SPECIAL_TEXT.get(token_id, "")
        return self._utf8.decode(bytes([token_id]))


class ByteTokenizer:
    """UTF-8 bytes as tokens; no BOS is added (prompts stay what users sent)."""

    vocab_size: int = BYTE_VOCAB_SIZE
    eos_token_ids: tuple[int, ...] = (BYTE_EOS_ID,)

    def encode(self, text: str) -> list[int]:
        # "<s>" and "</s>" written in the text are BOS and EOS, as its
        # tokenizer.json reads them (added tokens), so a text is the same ids
        # through kvstash.v1 and through a gateway tokenizing it.
        ids: list[int] = []
        for part in _SPECIAL_TEXT.split(text):
            special = _SPECIAL_IDS.get(part)
            if special is None:
                ids.extend(part.encode("utf-8"))
            else:
                ids.append(special)
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def stream(self, skip_special_tokens: bool = True,
               prompt_ids: Sequence[int] = ()) -> TextStream:
        return _ByteStream(skip_special_tokens, prompt_ids)


def _byte_level_chars() -> list[str]:
    """The character GPT-2's byte-level alphabet uses for each byte, by byte.

    Printable Latin-1 bytes stand for themselves; the other 68 are moved, in
    order, to U+0100 onwards. The `tokenizers` ByteLevel pre-tokenizer and
    decoder use this table but do not export it in byte order.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    moved = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(moved)) for b in range(256)]


def byte_tokenizer_json() -> str:
    """`ByteTokenizer` as a Hugging Face `tokenizer.json`.

    A merge-free BPE over the 256 byte-level characters, each with its byte
    value as id, so any text encodes to its UTF-8 bytes and `add_special_tokens`
    adds nothing (no post-processor). One difference: like every Hugging Face
    tokenizer, it matches "<s>" and "</s>" written in the text as BOS and EOS,
    where `ByteTokenizer` encodes their bytes; `tokenizer.json` cannot turn that
    off (`encode_special_tokens` is not saved in it).
    """
    vocab = {char: byte for byte, char in enumerate(_byte_level_chars())}
    # In the model's vocab too, so get_vocab_size(with_added_tokens=False) is 258.
    vocab |= {BYTE_BOS_TOKEN: BYTE_BOS_ID, BYTE_EOS_TOKEN: BYTE_EOS_ID}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (BYTE_BOS_TOKEN, BYTE_EOS_TOKEN)]
    )
    return str(tokenizer.to_str())


def byte_tokenizer_config(model_max_length: int | None = None) -> dict[str, str | bool | int]:
    """The `tokenizer_config.json` that goes with `byte_tokenizer_json()`."""
    config: dict[str, str | bool | int] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BYTE_BOS_TOKEN,
        "eos_token": BYTE_EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return config


class _HFStream:
    # DecodeStream waits while the text so far ends in U+FFFD, taking it for an
    # unfinished character: a real U+FFFD or invalid byte last is never emitted.
    def __init__(self, tokenizer: HFTokenizer, skip_special_tokens: bool,
                 prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt ending inside a character would be held, then sent with
        # the reply's first token: that text is the prompt's.
        if not tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith(
                "\ufffd"):
            for token_id in context:
                self._stream.step(tokenizer, token_id)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""


class HFTokenizerAdapter:
    """A Hugging Face `tokenizer.json`, as Llama and Qwen2 checkpoints ship it.
    A text is encoded as vLLM encodes a text prompt: with what the file's
    post-processor adds (a Llama checkpoint's BOS; a Qwen2 one adds none)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer = HFTokenizer.from_str(tokenizer_json)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str) -> list[int]:
        # With the tokenizer's special tokens (a Llama post-processor's BOS),
        # as vLLM encodes a text prompt. encode() holds the GIL throughout
        # (3 MB: 1.7 s, every other thread stopped); encode_batch() lets it go.
        return list(self._tokenizer.encode_batch([text], add_special_tokens=True)[0].ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def stream(self, skip_special_tokens: bool = True,
               prompt_ids: Sequence[int] = ()) -> TextStream:
        return _HFStream(self._tokenizer, skip_special_tokens, prompt_ids)


def load_tokenizer(
    tokenizer_json: bytes | str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> Tokenizer:
    """The tokenizer a worker described; empty `tokenizer_json` = byte-level."""
    if not tokenizer_json:
        return ByteTokenizer()
    text = tokenizer_json.decode() if isinstance(tokenizer_json, bytes) else tokenizer_json
    return HFTokenizerAdapter(text, vocab_size, eos_token_ids)


def tokenizer_files(tokenizer_json: str, tokenizer_config_json: str,
                    eos_token_ids: Sequence[int]) -> dict[str, str]:
    """What GetTokenizer zips for a worker's tokenizer ("" = the tiny model's
    bytes): tokenizer.json; tokenizer_config.json, the checkpoint's (with its
    chat template) or the tiny model's; config.json with the EOS ids (where
    gateways read them)."""
    if not tokenizer_json:
        tokenizer_json = byte_tokenizer_json()
        tokenizer_config_json = json.dumps(byte_tokenizer_config())
    elif not tokenizer_config_json:
        tokenizer_config_json = json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": tokenizer_config_json,
            "config.json": json.dumps({"eos_token_id": list(eos_token_ids)})}
