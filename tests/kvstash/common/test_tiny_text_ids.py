"""What the tiny model writes (TINY_TEXT_IDS and EOS) round-trips: its text
re-tokenizes to as many tokens as it was made of, with the byte tokenizer and
with its Hugging Face files, and holds nothing a terminal would act on."""

from __future__ import annotations

import unicodedata

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvstash.common.tokenizer import (
    BYTE_BOS_ID,
    BYTE_EOS_ID,
    BYTE_VOCAB_SIZE,
    TINY_TEXT_IDS,
    ByteTokenizer,
    byte_tokenizer_json,
)

HF = Tokenizer.from_str(byte_tokenizer_json())


def hf_ids(text: str) -> list[int]:
    # As load tools count: the default add_special_tokens=True.
    return list(HF.encode(text).ids)


def test_every_text_token_is_one_printable_character_that_encodes_back_alone() -> None:
    byte = ByteTokenizer()
    assert len(set(TINY_TEXT_IDS)) == len(TINY_TEXT_IDS) == 93
    for token_id in TINY_TEXT_IDS:
        text = byte.decode([token_id])
        assert len(text) == 1 and text.isprintable() and text.isascii(), token_id
        assert unicodedata.category(text) != "Cc"
        assert byte.encode(text) == hf_ids(text) == [token_id]
        assert HF.decode([token_id]) == text


def test_no_special_token_and_nothing_that_spells_one() -> None:
    assert BYTE_BOS_ID not in TINY_TEXT_IDS and BYTE_EOS_ID not in TINY_TEXT_IDS
    assert all(0 <= t < BYTE_VOCAB_SIZE for t in TINY_TEXT_IDS)
    # "<s>" and "</s>" in text are one token each to a Hugging Face tokenizer.
    assert not {ord("<"), ord(">")} & set(TINY_TEXT_IDS)


def test_the_rest_of_the_vocabulary_would_not_round_trip() -> None:
    """Why the model writes only these: every other token is a control
    character, part of a multi-byte character, or a token without text."""
    byte = ByteTokenizer()
    for token_id in set(range(BYTE_VOCAB_SIZE)) - set(TINY_TEXT_IDS):
        text = byte.decode([token_id])
        assert (token_id in (ord("<"), ord(">")) or text in ("", "\ufffd")
                or unicodedata.category(text) == "Cc"), token_id


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(TINY_TEXT_IDS), max_size=200), st.booleans())
def test_any_output_re_tokenizes_to_its_own_tokens(token_ids: list[int], eos: bool) -> None:
    byte = ByteTokenizer()
    text = byte.decode([*token_ids, *([BYTE_EOS_ID] if eos else [])])
    assert HF.decode([*token_ids, *([BYTE_EOS_ID] if eos else [])],
                     skip_special_tokens=True) == text
    assert hf_ids(text) == byte.encode(text) == token_ids
    stream = byte.stream()
    assert "".join(stream.push(t) for t in token_ids) == text
