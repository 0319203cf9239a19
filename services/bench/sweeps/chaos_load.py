"""The load of `kvserve bench chaos`: `--rate` requests/s while `running`, cycling through
streaming and non-streaming, greedy and sampled (temperature 1.0) /v1/completions of a shared
system prompt + one of QUESTIONS, `--max-tokens` each, and each request's `Outcome` (its kinds:
sweeps/chaos.py). Only a streamed greedy answer is compared with the fault-free reference."""

from __future__ import annotations

import argparse
import asyncio
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

    def body(self, kind: str, question: int, stream: bool) -> dict[str, Any]:
        return {
            "prompt": SYSTEM + QUESTIONS[question],
            "max_tokens": self.args.max_tokens,
            "temperature": 0.0 if kind.endswith("greedy") else 1.0,
            "ignore_eos": True,
            "stream": stream,
        }

    async def one(self, kind: str, question: int, drop_after_first: bool = False) -> Outcome:
        o = Outcome(len(self.outcomes), kind, question, time.monotonic() - self.t0, self.phase)
        self.outcomes.append(o)
        try:
            async with asyncio.timeout(self.args.timeout):
                if not await self._send_one(o, drop_after_first):
                    return o  # an error status or a whole answer: as it came
        except TimeoutError:
            o.result = "lost"
        except OSError as e:  # aiohttp's connection errors are OSErrors
            refused = isinstance(e, ConnectionRefusedError) or "Cannot connect" in str(e)
            o.result = "refused" if refused and o.status is None else "lost"
        if o.result == "ok" and kind.endswith("greedy") and question in self.reference:
            o.result = "ok" if o.text == self.reference[question] else "wrong"
        return o

    async def _send_one(self, o: Outcome, drop_after_first: bool) -> bool:
        """Send `o`'s request and record its answer; True when it was streamed (a streamed
        greedy answer is then compared with the reference)."""
        stream = o.kind.startswith("stream")
        t = time.monotonic()
        async with self.http.post(
            self.base_url + "/v1/completions", json=self.body(o.kind, o.question, stream)
        ) as resp:
            o.status = resp.status
            if resp.status != 200:
                o.result = f"http_{resp.status}"
                o.retry_after = "Retry-After" in resp.headers
                return False
            if not stream:
                data = await resp.json()
                o.ttft_s = time.monotonic() - t
                o.text = data["choices"][0]["text"]
                o.result = "ok" if data["choices"][0].get("finish_reason") else "lost"
                return False
            await self._stream(o, resp, t, drop_after_first)
            return True

    async def _stream(self, o: Outcome, resp: Any, t: float, drop: bool) -> None:
        parts, finished = [], False
        async for chunk in sse_chunks(resp.content):
            if "error" in chunk:
                o.result = "stream_error"
                return
            for c in chunk.get("choices") or []:
                if o.ttft_s is None:
                    o.ttft_s = time.monotonic() - t
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
                task = asyncio.create_task(self._send(i))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                i += 1
            await asyncio.sleep(1.0 / self.args.rate)

    async def _send(self, i: int) -> None:
        await self.one(KINDS[i % len(KINDS)], i % len(QUESTIONS))

    async def drain(self) -> None:
        """Stop sending and wait for every request in flight to end."""
        self.running = False
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
