"""Chat logprobs name each token's own bytes (OpenAI's `bytes`): where a token holds part of a
UTF-8 character, `token` reads U+FFFD but `bytes` hold the part, so the bytes of consecutive
tokens join into the generated text; the same for the top_logprobs alternatives, in streamed
chunks, and with `return_tokens_as_token_ids`."""

from __future__ import annotations

from typing import Any

from kvserve.services.gateway.responses import ResponseBuilder
from kvserve.services.gateway.schema import GenerationPlan
from kvserve.shared.model.tokenizer import IncrementalDetokenizer, KVTokenizer
from kvserve.shared.protocol import TokenEvent
from kvserve.shared.sampling_params import SamplingParams

TEXT = "café🙂 日本語"
REPLACEMENT = [239, 191, 189]  # U+FFFD's UTF-8: what a token's lossy text would give


def builder(tokenizer: KVTokenizer, tokens_as_ids: bool = False) -> ResponseBuilder:
    params = SamplingParams(logprobs=True, top_logprobs=2)
    plan = GenerationPlan(
        "chat", "m", [[1, 2, 3]], params, logprobs=True, tokens_as_ids=tokens_as_ids
    )
    return ResponseBuilder(plan, "chatcmpl-test", tokenizer, "m")


def events(tokenizer: KVTokenizer, ids: list[int]) -> list[TokenEvent]:
    """One event per token, its text as a worker detokenizes it; the alternatives of each token
    are itself and the token after it (the last one's: the first)."""
    detok = IncrementalDetokenizer(tokenizer)
    out = []
    for i, t in enumerate(ids):
        alternatives = [[t, -0.5], [ids[(i + 1) % len(ids)], -1.5]]
        last = i == len(ids) - 1
        out.append(
            TokenEvent("r", i, token_ids=[t], text=detok.add(t), logprobs=[-0.5],
                       finish_reason="stop" if last else None, top_logprobs=[alternatives])
        )  # fmt: skip
    return out


def joined(entries: list[dict[str, Any]]) -> str:
    return b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8")


def test_chat_logprob_bytes_are_each_tokens_own(tokenizer: KVTokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    b = builder(tokenizer)
    for ev in events(tokenizer, ids):
        b.add(0, ev)
    (choice,) = b.final()["choices"]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == joined(content) == TEXT
    partial = [e for e in content if "\ufffd" in e["token"]]
    assert len(partial) == 8  # 🙂 in two tokens, " 日" and 語 in three each
    assert all(e["bytes"] != REPLACEMENT and REPLACEMENT[0] not in e["bytes"] for e in partial)
    assert [e["token"] for e in content[3:5]] == ["\ufffd", "\ufffd\ufffd"]
    assert [e["bytes"] for e in content[3:5]] == [[240, 159], [153, 130]]  # 🙂: F0 9F 99 82
    for entry, t, nxt in zip(content, ids, ids[1:] + ids[:1], strict=True):
        assert entry["bytes"] == list(tokenizer.token_bytes(t))
        assert [a["bytes"] for a in entry["top_logprobs"]] == [
            list(tokenizer.token_bytes(t)), list(tokenizer.token_bytes(nxt))
        ]  # fmt: skip
        assert [a["token"] for a in entry["top_logprobs"]] == [
            tokenizer.decode([t], False), tokenizer.decode([nxt], False)
        ]  # fmt: skip


def test_streamed_and_id_named_tokens_keep_their_bytes(tokenizer: KVTokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    for as_ids in (False, True):
        b = builder(tokenizer, tokens_as_ids=as_ids)
        chunks = [b.event_chunk(0, ev)["choices"][0] for ev in events(tokenizer, ids)]
        content = [e for c in chunks for e in c["logprobs"]["content"]]
        assert "".join(c["delta"].get("content", "") for c in chunks) == joined(content) == TEXT
        if as_ids:
            assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
