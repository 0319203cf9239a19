"""Request functions of the serving benchmark: one streamed /v1/completions request with the
prompt as token ids, timed chunk by chunk into a `RequestResult` (TTFT, inter-token latencies,
TPOT, end-to-end latency, usage), and /tokenize. Any OpenAI-compatible server; aiohttp, no
torch."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    index: int
    session: str
    turn: int
    request_rate: float | None
    prompt_len: int  # tokens sent
    max_tokens: int
    start_s: float = 0.0  # sent, seconds after the run's start
    success: bool = False
    error: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server counted them
    cached_tokens: int | None = None
    reusable_tokens: int = 0  # what a perfect prefix cache could have served when it was sent
    text: str = ""


async def sse_chunks(content: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a server-sent event stream, up to `data: [DONE]`."""
    async for raw in content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class StreamedCompletion:
    """One streamed completion's chunks as they arrive, timed into `res` (TTFT at the first
    chunk with a token, ITL between such chunks; a bare finish_reason chunk is not a token)."""

    def __init__(self, res: RequestResult, t0: float) -> None:
        self.res = res
        self.t0 = self.last = t0
        self.chunks = 0
        self.token_ids: list[int] = []
        self.have_ids = False
        self.text: list[str] = []
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            return
        c = choices[0]
        if c.get("token_ids") is not None:
            self.have_ids = True
            self.token_ids += c["token_ids"]
        if not c.get("text") and not c.get("token_ids") and c.get("finish_reason"):
            return  # a bare finish_reason chunk (an empty text is a token too)
        now = time.perf_counter()
        if self.chunks == 0:
            self.res.ttft_s = now - self.t0
        else:
            self.res.itl_s.append(now - self.last)
        self.last = now
        self.chunks += 1
        self.text.append(c.get("text") or "")

    def finish(self) -> list[int] | None:
        """Fill in the rest of `res` at the stream's end; the answer's token ids when the
        server sent them."""
        res = self.res
        res.e2e_s = time.perf_counter() - self.t0
        res.text = "".join(self.text)
        if self.usage:
            res.output_tokens = int(self.usage.get("completion_tokens") or 0)
            res.prompt_tokens = self.usage.get("prompt_tokens")
            details = self.usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                res.cached_tokens = int(details["cached_tokens"])
        if not res.output_tokens:
            res.output_tokens = len(self.token_ids) if self.have_ids else self.chunks
        if res.ttft_s is None:
            res.error = "no token received"
            return None
        if res.output_tokens > 1:
            res.tpot_s = (res.e2e_s - res.ttft_s) / (res.output_tokens - 1)
        res.success = True
        return self.token_ids if self.have_ids else None


class Client:
    """Streaming token-id completions against one OpenAI-compatible server (aiohttp session
    given), greedy, EOS ignored, usage included."""

    def __init__(self, args: argparse.Namespace, model: str, session: Any) -> None:
        self.url = args.base_url.rstrip("/")
        self.model = model
        self.http = session
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }

    async def complete(self, prompt: list[int], res: RequestResult) -> list[int] | None:
        """Streams one completion into `res`; returns the answer's token ids when the server
        sent them (vLLM's return_token_ids), else None."""
        body = self.body(prompt, res.max_tokens)
        stream = StreamedCompletion(res, time.perf_counter())
        try:
            async with self.http.post(
                self.url + "/v1/completions", json=body, headers=self.headers
            ) as resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return None
                async for chunk in sse_chunks(resp.content):
                    if "error" in chunk:
                        res.error = str(chunk["error"])[:300]
                        return None
                    stream.add(chunk)
        except (TimeoutError, OSError, ValueError) as e:  # aiohttp errors are OSErrors
            res.error = f"{type(e).__name__}: {e}"[:300]
            return None
        return stream.finish()

    async def tokenize(self, text: str) -> list[int] | None:
        try:
            async with self.http.post(
                self.url + "/tokenize",
                json={"model": self.model, "prompt": text, "add_special_tokens": False},
                headers=self.headers,
            ) as resp:
                if resp.status != 200:
                    return None
                ids = (await resp.json()).get("tokens")
        except (TimeoutError, OSError, ValueError):
            return None
        return [int(t) for t in ids] if isinstance(ids, list) else None
