"""The load of `kvserve bench chaos`: `--rate` requests/s while `running`, cycling through
streaming and non-streaming, greedy and sampled (temperature 1.0) /v1/completions of a shared
system prompt + one of QUESTIONS, `--max-tokens` each, and each request's `Outcome` (its kinds:
sweeps/chaos.py). Only a streamed greedy answer is compared with the fault-free reference.
A poisoned request (`one(..., fault=...)`) asks the server for a fault (`kvserve_fault`); its
outcome says which, and any failure's error `code`, as every failure's does."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from kvserve.services.bench.lib.completions import sse_chunks
from kvserve.services.cli_support import CliError

SYSTEM = (
    "You are the help desk of a city library. Answer in one or two short sentences, politely, "
    "about opening hours, borrowing rules, study rooms, the catalogue and library cards. "
) * 3
QUESTIONS = [f"Question {i}: may I borrow {i + 2} books for {i + 1} weeks?" for i in range(8)]
KINDS = ("stream-greedy", "plain-greedy", "stream-sampled", "plain-sampled")


@dataclass
class Outcome:
    index: int
    kind: str
    question: int
    sent_s: float  # seconds after the run's start
    phase: str = ""  # "calm:FAULT" or FAULT (from its start to the end of its recovery)
    result: str = "lost"
    status: int | None = None
    retry_after: bool = False
    ttft_s: float | None = None
    text: str = ""
    code: str | None = None  # a failure's error code (the body's or the error event's)
    fault: str | None = None  # a poisoned request: the kvserve_fault it asked for
    done_s: float | None = None  # when it ended, seconds after the run's start


class Load:
    """Sends requests at a steady rate (while `running`) and records their outcomes; `phase`
    labels the requests sent from now on."""

    def __init__(self, base_url: str, kind: str, args: argparse.Namespace, http: Any) -> None:
        self.base_url, self.kind, self.args, self.http = base_url, kind, args, http
        self.outcomes: list[Outcome] = []
        self.reference: dict[int, str] = {}
        self.phase = "warm-up"
        self.running = False
        self.t0 = time.monotonic()
        self._tasks: set[asyncio.Task[None]] = set()

    def body(self, kind: str, question: int, stream: bool, fault: str | None) -> dict[str, Any]:
        body = {
            "prompt": SYSTEM + QUESTIONS[question],
            "max_tokens": self.args.max_tokens,
            "temperature": 0.0 if kind.endswith("greedy") else 1.0,
            "ignore_eos": True,
            "stream": stream,
        }
        return {**body, "kvserve_fault": fault} if fault else body

    async def one(
        self,
        kind: str,
        question: int,
        drop_after_first: bool = False,
        fault: str | None = None,
        first: asyncio.Event | None = None,
    ) -> Outcome:
        """One request and its outcome; `first` is set once its first chunk came (or it
        ended)."""
        o = Outcome(len(self.outcomes), kind, question, time.monotonic() - self.t0, self.phase)
        o.fault = fault
        self.outcomes.append(o)
        first = first or asyncio.Event()
        try:
            async with asyncio.timeout(self.args.timeout):
                if not await self._send_one(o, drop_after_first, first):
                    return o  # an error status or a whole answer: as it came
        except TimeoutError:
            o.result = "lost"
        except OSError as e:  # aiohttp's connection errors are OSErrors
            refused = isinstance(e, ConnectionRefusedError) or "Cannot connect" in str(e)
            o.result = "refused" if refused and o.status is None else "lost"
        finally:
            o.done_s = time.monotonic() - self.t0
            first.set()
        if o.result == "ok" and kind.endswith("greedy") and question in self.reference:
            o.result = "ok" if o.text == self.reference[question] else "wrong"
        return o

    async def _send_one(self, o: Outcome, drop_after_first: bool, first: asyncio.Event) -> bool:
        """Send `o`'s request and record its answer; True when it was streamed (a streamed
        greedy answer is then compared with the reference)."""
        stream = o.kind.startswith("stream")
        t = time.monotonic()
        async with self.http.post(
            self.base_url + "/v1/completions", json=self.body(o.kind, o.question, stream, o.fault)
        ) as resp:
            o.status = resp.status
            if resp.status != 200:
                o.result = f"http_{resp.status}"
                o.retry_after = "Retry-After" in resp.headers
                o.code = error_code(await resp.read())
                return False
            if not stream:
                data = await resp.json()
                o.ttft_s = time.monotonic() - t
                o.text = data["choices"][0]["text"]
                o.result = "ok" if data["choices"][0].get("finish_reason") else "lost"
                return False
            await self._stream(o, resp, t, drop_after_first, first)
            return True

    async def _stream(
        self, o: Outcome, resp: Any, t: float, drop: bool, first: asyncio.Event
    ) -> None:
        parts, finished = [], False
        async for chunk in sse_chunks(resp.content):
            if "error" in chunk:
                o.result = "stream_error"
                o.code = _code(chunk["error"])
                return
            for c in chunk.get("choices") or []:
                if o.ttft_s is None:
                    o.ttft_s = time.monotonic() - t
                    first.set()
                parts.append(c.get("text") or "")
                finished = finished or bool(c.get("finish_reason"))
            if drop and o.ttft_s is not None:
                o.result = "disconnected"
                return
        o.text = "".join(parts)
        o.result = "ok" if finished else "lost"

    async def references(self) -> None:
        """Every question's greedy answer, fault-free (also warms the caches)."""
        for q in range(len(QUESTIONS)):
            o = await self.one("plain-greedy", q)
            if o.result != "ok":
                raise CliError(f"{self.kind}: a fault-free request failed: {o.result}")
            self.reference[q] = o.text
        self.outcomes.clear()

    async def run(self) -> None:
        """Send at the rate while `running` (a task per request)."""
        i = 0
        while True:
            if self.running:
                self.start(KINDS[i % len(KINDS)], i % len(QUESTIONS))
                i += 1
            await asyncio.sleep(1.0 / self.args.rate)

    def start(
        self, kind: str, question: int, fault: str | None = None, first: asyncio.Event | None = None
    ) -> None:
        """Send one request now, as a task of its own (`drain` waits for it too); `first`: as
        `one`'s."""
        task = asyncio.create_task(self._send(kind, question, fault, first))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(
        self, kind: str, question: int, fault: str | None, first: asyncio.Event | None
    ) -> None:
        await self.one(kind, question, fault=fault, first=first)

    async def streaming(self, n: int, timeout: float = 60.0) -> None:
        """Start `n` greedy streams (questions 0..n-1) and return once each has had its first
        chunk (or ended), or after `timeout`: requests in flight for a fault to strike."""
        firsts = [asyncio.Event() for _ in range(n)]
        for q, first in enumerate(firsts):
            self.start("stream-greedy", q % len(QUESTIONS), first=first)
        waits = [asyncio.create_task(f.wait()) for f in firsts]
        _, pending = await asyncio.wait(waits, timeout=timeout)
        for w in pending:
            w.cancel()

    async def drain(self) -> None:
        """Stop sending and wait for every request in flight to end."""
        self.running = False
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def error_code(body: bytes) -> str | None:
    """The `code` of an OpenAI-shaped error body ({"error": {"code": ...}}), else None."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return _code(data.get("error")) if isinstance(data, dict) else None


def _code(error: Any) -> str | None:
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code is not None else None
