"""One run of the serving benchmark: every session started at its arrival time (Poisson at a
rate, all at once for `inf`, a trace's own times), its turns sent in order, the results kept in
start order; and the unmeasured warm-up requests before it.

Arrival times, start times and the run's duration are modelled seconds: against a server that
runs --slowdown S times slower than the time it models, a modelled second lasts S wall seconds
(so the client sends at rate / S)."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from typing import Any

from kvserve.services.bench.lib.completions import Client, RequestResult
from kvserve.services.bench.lib.reuse import ReuseTracker
from kvserve.services.bench.workloads.sessions import Session
from kvserve.services.bench.workloads.tokens import random_tokens


def arrival_times(sessions: list[Session], rate: float | None, seed: int) -> list[float]:
    """Session start times (s): Poisson at `rate`, 0 for inf, the trace's for rate None."""
    if rate is None:
        return [s.arrival_s or 0.0 for s in sessions]
    if math.isinf(rate):
        return [0.0] * len(sessions)
    rng = random.Random(f"arrivals:{seed}")
    t, out = 0.0, []
    for _ in sessions:
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_once(
    args: argparse.Namespace,
    client: Client,
    sessions: list[Session],
    rate: float | None,
    vocab_size: int,
) -> tuple[list[RequestResult], float]:
    """Every session started at its arrival time (at `rate`); the results in start order and
    the run's duration in modelled seconds."""
    from tqdm import tqdm

    total = sum(s.num_requests for s in sessions)
    bar = tqdm(total=total, desc=f"rate {rate}", unit="req", disable=not sys.stderr.isatty())
    starts = arrival_times(sessions, rate, args.seed)
    run = SessionRunner(args, client, rate, vocab_size, bar.update)
    await asyncio.gather(
        *(run.session(k, s, at) for k, (s, at) in enumerate(zip(sessions, starts, strict=True)))
    )
    duration = run.now()
    bar.close()
    return run.results, duration


class SessionRunner:
    """One run's sessions: each waits for its start time, then sends its turns in order (a
    multi-round one carries its history: the prompt plus the answer's token ids, from the
    server, else re-tokenized, else stand-ins of the same count). At most --max-concurrency
    requests are in flight. Each request's prompt goes to the `ReuseTracker` when it is sent,
    its prompt and answer when it finishes."""

    def __init__(
        self,
        args: argparse.Namespace,
        client: Client,
        rate: float | None,
        vocab_size: int,
        progress: Any,
    ) -> None:
        self.seed = args.seed
        self.slowdown = args.slowdown
        self.client = client
        self.rate = rate
        self.vocab_size = vocab_size
        self.progress = progress  # progress(n): n more requests done
        self.sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        self.results: list[RequestResult] = []
        self.reuse = ReuseTracker(args.reuse_block_size)
        self.t_start = time.perf_counter()

    def now(self) -> float:
        """Modelled seconds since the run's start: the one place the run's wall clock is
        divided by the slowdown."""
        return (time.perf_counter() - self.t_start) / self.slowdown

    async def request(self, prompt: list[int], res: RequestResult) -> list[int] | None:
        if self.sem is None:
            return await self._send(prompt, res)
        async with self.sem:
            return await self._send(prompt, res)

    async def _send(self, prompt: list[int], res: RequestResult) -> list[int] | None:
        res.start_s = self.now()
        res.reusable_tokens = self.reuse.observe(prompt)
        return await self.client.complete(prompt, res)

    async def session(self, k: int, s: Session, at: float) -> None:
        delay = at - self.now()
        if delay > 0:
            await asyncio.sleep(delay * self.slowdown)  # to its arrival time, in wall seconds
        history: list[int] = []
        for j, turn in enumerate(s.turns):
            prompt = history + turn.tokens if s.carry_history else turn.tokens
            res = RequestResult(k, s.tag, j, self.rate, len(prompt), turn.output_len, s.user)
            self.results.append(res)
            ids = await self.request(prompt, res)
            self.progress(1)
            if not s.carry_history:
                if ids:
                    self.reuse.add(prompt + ids)
                continue
            if not res.success:
                self._skip_rest(k, s, j)  # the conversation cannot go on
                break
            history = prompt + await self._answer_ids(ids, res, k, j)
            self.reuse.add(history)

    def _skip_rest(self, k: int, s: Session, j: int) -> None:
        for i, rest in enumerate(s.turns[j + 1 :], start=j + 1):
            skipped = RequestResult(k, s.tag, i, self.rate, 0, rest.output_len, s.user)
            skipped.error = "skipped: an earlier round failed"
            self.results.append(skipped)
            self.progress(1)

    async def _answer_ids(
        self, ids: list[int] | None, res: RequestResult, k: int, j: int
    ) -> list[int]:
        if ids is None:
            ids = await self.client.tokenize(res.text)
        if ids is None:  # no ids from the server: stand-ins of the same count
            rng = random.Random(f"answer:{self.seed}:{k}:{j}")
            ids = random_tokens(rng, res.output_tokens, self.vocab_size)
        return ids


async def warmup(args: argparse.Namespace, client: Client, vocab_size: int) -> None:
    rng = random.Random(f"warmup:{args.seed}")
    jobs = []
    for i in range(args.warmup_requests):
        res = RequestResult(i, "warmup", 0, None, 16, 4)
        jobs.append(client.complete(random_tokens(rng, 16, vocab_size), res))
    await asyncio.gather(*jobs)
