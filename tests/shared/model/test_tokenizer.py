"""Incremental detokenization equals decoding the whole output, whatever the split."""

from __future__ import annotations

from kvserve.shared.model.tokenizer import IncrementalDetokenizer


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
