"""Incremental detokenization equals decoding the whole output, whatever the split; a token's own
bytes (GPT-2's byte alphabet) join into the text where decoding tokens alone cannot."""

from __future__ import annotations

from kvserve.shared.model.tokenizer import (
    BYTE_OF_CHAR,
    IncrementalDetokenizer,
    KVTokenizer,
    TokenizerInfo,
)


def test_incremental_text_equals_full_decode(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "Unicode: café, naïve, 日本語 and emoji 🚀🚀 — done.\nNew line,  spaces."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_skipped(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add(i) for i in ids) == tokenizer.decode(ids) == "assistant\nHi"


def test_byte_alphabet_is_gpt2s() -> None:
    from tokenizers import pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert {c: b for b, c in bytes_to_unicode().items()} == BYTE_OF_CHAR
    assert set(pre_tokenizers.ByteLevel.alphabet()) == set(BYTE_OF_CHAR)


def test_token_bytes_are_the_tokens_own(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A token that holds part of a UTF-8 character decodes to U+FFFD alone, but its bytes are
    its part: the bytes of consecutive tokens join into the text."""
    text = "café 🙂 日本語 ÿ"
    ids = tokenizer.encode(text)
    parts = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(parts).decode("utf-8") == text
    assert "\ufffd".encode() not in b"".join(parts)
    smile = tokenizer.encode("🙂")
    assert [tokenizer.decode([i]) for i in smile] == ["\ufffd", "\ufffd\ufffd"]
    assert [tokenizer.token_bytes(i) for i in smile] == [b"\xf0\x9f", b"\x99\x82"]
    # Whole characters and added tokens: their text's UTF-8.
    (e_acute,) = tokenizer.encode("é")
    assert tokenizer.token_bytes(e_acute) == "é".encode()
    start = tokenizer.encode("<|im_start|>")
    assert [tokenizer.token_bytes(i) for i in start] == [b"<|im_start|>"]


def test_token_bytes_without_a_byte_level_decoder() -> None:
    """Another decoder's token: the UTF-8 of its text decoded alone."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"é": 0, "[UNK]": 1}, unk_token="[UNK]"))
    kv = KVTokenizer(tok, TokenizerInfo(None, None, (), None))
    assert not kv.byte_level and kv.token_bytes(0) == "é".encode()
