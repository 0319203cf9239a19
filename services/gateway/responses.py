"""Token events -> OpenAI response bodies and SSE chunks (completions and chat).

`ResponseBuilder` accumulates every choice of one HTTP request (prompt p, completion i is choice
p * n + i, as vLLM numbers them) and renders either the final body or, per event, the stream
chunks. Usage counts the prompt tokens once per prompt (n samples share it) and the generated
tokens of every choice; `prompt_tokens_details.cached_tokens` is what the prefix cache served
(per prompt the largest count its events reported), and the kvserve extension
`prompt_tokens_details.cached_tokens_by_tier` splits it by the tier the tokens came from (device
cache, host-RAM tier, store), as reported with that count: the tiers sum to `cached_tokens`
(a worker from before them reports none: zeros).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.services.gateway.schema import GenerationPlan
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.protocol import TokenEvent


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list[float]]] = field(default_factory=list)
    finish_reason: str | None = None


TIERS = ("device", "host", "store")  # fastest first, as the engine names them


@dataclass
class _PromptUsage:
    prompt_tokens: int
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    store_lookup: str | None = None

    def take(self, event: TokenEvent) -> None:
        """The largest cached count reported, with the tiers reported with it; the store
        lookup's outcome, once reported."""
        n = event.num_cached_tokens
        if n > self.cached_tokens or (n == self.cached_tokens and not self.cached_by_tier):
            self.cached_tokens, self.cached_by_tier = n, dict(event.cached_tokens_by_source)
        if event.store_lookup is not None:
            self.store_lookup = event.store_lookup


class ResponseBuilder:
    def __init__(
        self, plan: GenerationPlan, response_id: str, tokenizer: KVTokenizer, model: str
    ) -> None:
        self.plan = plan
        self.id = response_id
        self.created = int(time.time())
        self.model = model
        self.tok = tokenizer
        n = plan.params.n
        self.n = n
        self.choices = [_Choice(i) for i in range(len(plan.prompts) * n)]
        self.prompts = [_PromptUsage(len(p)) for p in plan.prompts]
        self.chat = plan.kind == "chat"
        self.object = "chat.completion" if self.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"

    # ---- accumulate -----------------------------------------------------------------------

    def add(self, prompt_index: int, event: TokenEvent) -> _Choice:
        self.prompts[prompt_index].take(event)
        c = self.choices[prompt_index * self.n + event.index]
        c.text.append(event.text)
        c.token_ids += event.token_ids
        c.logprobs += event.logprobs
        c.top_logprobs += event.top_logprobs
        if event.finish_reason is not None:
            c.finish_reason = event.finish_reason
        return c

    @property
    def finish_reasons(self) -> list[str]:
        return [c.finish_reason or "" for c in self.choices]

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def store_lookup(self) -> str | None:
        """How the prompts' store lookups ended, when every one that reported agrees."""
        outcomes = {p.store_lookup for p in self.prompts if p.store_lookup is not None}
        return outcomes.pop() if len(outcomes) == 1 else None

    def usage(self) -> dict[str, Any]:
        prompt = sum(p.prompt_tokens for p in self.prompts)
        completion = self.completion_tokens
        by_tier = {t: sum(p.cached_by_tier.get(t, 0) for p in self.prompts) for t in TIERS}
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": sum(p.cached_tokens for p in self.prompts),
                "cached_tokens_by_tier": by_tier,
            },
        }

    # ---- final body -----------------------------------------------------------------------

    def _body(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The fields every body and chunk starts with (`usage` follows where it goes)."""
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def final(self) -> dict[str, Any]:
        body = self._body(self.object, [self._final_choice(c) for c in self.choices])
        body["usage"] = self.usage()
        return body

    def _final_choice(self, c: _Choice) -> dict[str, Any]:
        text = "".join(c.text)
        lp = self._logprobs(c.token_ids, c.logprobs, c.top_logprobs) if self.plan.logprobs else None
        if self.chat:
            return {
                "index": c.index,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": c.finish_reason,
            }
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}

    def _token(self, token_id: int) -> str:
        if self.plan.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tok.decode([token_id], skip_special_tokens=False)

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        """One token's chat logprob: `token` its text (U+FFFD for part of a UTF-8 character),
        `bytes` its own bytes, so a client that joins the bytes of consecutive tokens gets the
        character back (OpenAI's meaning; vLLM sends the bytes of the text)."""
        return {
            "token": self._token(token_id),
            "logprob": logprob,
            "bytes": list(self.tok.token_bytes(token_id)),
        }

    def _logprobs(
        self, token_ids: list[int], logprobs: list[float], tops: list[list[list[float]]]
    ) -> dict[str, Any]:
        k = self.plan.params.top_logprobs
        if self.chat:
            content = []
            for i, (token_id, lp) in enumerate(zip(token_ids, logprobs, strict=False)):
                top = tops[i] if k and i < len(tops) else []
                likeliest = [self._chat_entry(int(a), v) for a, v in top]
                content.append({**self._chat_entry(token_id, lp), "top_logprobs": likeliest})
            return {"content": content}
        tokens = [self._token(t) for t in token_ids]
        alts = [[(self._token(int(t)), v) for t, v in top] for top in tops] if k else []
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            # OpenAI's shape: one {token text: logprob} per token (texts that decode alike
            # merge, keeping the likelier)
            "top_logprobs": [_top_dict(a) for a in alts] if k else None,
            "text_offset": offsets,
        }

    # ---- stream chunks --------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = self._body(self.chunk_object, choices)
        if self.plan.include_usage:
            chunk["usage"] = None
        return chunk

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role (as OpenAI and vLLM do)."""
        if not self.chat:
            return []
        return [
            self._chunk(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for c in self.choices
        ]

    def event_chunk(self, prompt_index: int, event: TokenEvent) -> dict[str, Any]:
        c = self.add(prompt_index, event)
        lp = (
            self._logprobs(event.token_ids, event.logprobs, event.top_logprobs)
            if self.plan.logprobs
            else None
        )
        if self.chat:
            delta = {"content": event.text} if event.text or c.finish_reason is None else {}
            choice = {
                "index": c.index,
                "delta": delta,
                "logprobs": lp,
                "finish_reason": event.finish_reason,
            }
        else:
            choice = {
                "index": c.index,
                "text": event.text,
                "logprobs": lp,
                "finish_reason": event.finish_reason,
            }
        return self._chunk([choice])

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with `include_usage`: no choices, the whole usage."""
        chunk = self._body(self.chunk_object, [])
        chunk["usage"] = self.usage()
        return chunk


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _top_dict(alternatives: list[tuple[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for text, lp in alternatives:
        if text not in out or lp > out[text]:
            out[text] = lp
    return out
