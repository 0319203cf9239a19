"""Request functions of the serving benchmark: one streamed /v1/completions request with the
prompt as token ids, timed chunk by chunk into a `RequestResult` (TTFT, inter-token latencies,
TPOT, end-to-end latency, usage), and /tokenize. Any OpenAI-compatible server; aiohttp, no
torch.

Timings are recorded in modelled seconds: wall seconds divided by the slowdown S of a server
that runs S times slower than the time it models (simulated workers; S = 1 for a real one)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any


@dataclass
class RequestResult:
    index: int
    session: str
    turn: int
    request_rate: float | None
    prompt_len: int  # tokens sent
    max_tokens: int
    user: str = ""  # the session's user key (sent as the OpenAI `user` under --send-user)
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
    """One streamed completion's chunks as they arrive, each chunk with a token timestamped (a
    bare finish_reason chunk is not a token); `finish` records into `res` TTFT (to the first
    such chunk), ITL (between them) and e2e, divided by `slowdown`."""

    def __init__(self, res: RequestResult, t0: float, slowdown: float) -> None:
        self.res = res
        self.t0 = t0  # perf_counter() when the request was sent
        self.slowdown = slowdown
        self.token_times: list[float] = []  # perf_counter() at each chunk with a token
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
        self.token_times.append(time.perf_counter())
        self.text.append(c.get("text") or "")

    def finish(self) -> list[int] | None:
        """Fill in the rest of `res` at the stream's end; the answer's token ids when the
        server sent them."""
        end = time.perf_counter()
        res = self.res
        res.text = "".join(self.text)
        if self.usage:
            res.output_tokens = int(self.usage.get("completion_tokens") or 0)
            res.prompt_tokens = self.usage.get("prompt_tokens")
            details = self.usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                res.cached_tokens = int(details["cached_tokens"])
        if not res.output_tokens:
            res.output_tokens = len(self.token_ids) if self.have_ids else len(self.token_times)
        self._record_times(end)
        if res.ttft_s is None:
            res.error = "no token received"
            return None
        res.success = True
        return self.token_ids if self.have_ids else None

    def _record_times(self, end: float) -> None:
        """e2e (to `end`), TTFT, ITL and TPOT (with more than one output token) into `res`, in
        modelled seconds: the one place a request's wall times are divided by the slowdown."""
        s, t, res = self.slowdown, self.token_times, self.res
        res.e2e_s = e2e = (end - self.t0) / s
        if not t:
            return
        res.ttft_s = ttft = (t[0] - self.t0) / s
        res.itl_s = [(b - a) / s for a, b in pairwise(t)]
        if res.output_tokens > 1:
            res.tpot_s = (e2e - ttft) / (res.output_tokens - 1)


class Client:
    """Streaming token-id completions against one OpenAI-compatible server (aiohttp session
    given), greedy, EOS ignored, usage included; with --send-user each request names its user;
    timings divided by --slowdown."""

    def __init__(self, args: argparse.Namespace, model: str, session: Any) -> None:
        self.url = args.base_url.rstrip("/")
        self.model = model
        self.http = session
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.send_user = args.send_user
        self.slowdown = args.slowdown

    def body(self, prompt: list[int], res: RequestResult) -> dict[str, Any]:
        """The request body of `res`: carries `user` only under --send-user and for a request
        that has a user key (the warm-up's have none)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": res.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if self.send_user and res.user:
            body["user"] = res.user
        return body

    async def complete(self, prompt: list[int], res: RequestResult) -> list[int] | None:
        """Streams one completion into `res`; returns the answer's token ids when the server
        sent them (vLLM's return_token_ids), else None."""
        body = self.body(prompt, res)
        stream = StreamedCompletion(res, time.perf_counter(), self.slowdown)
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
