"""`kvserve bench serve`: the serving benchmark, an HTTP client of any OpenAI-compatible server.

Streaming /v1/completions requests with the prompt as token ids (every server sees the same
tokens), greedy (temperature 0), `ignore_eos` and a fixed `max_tokens` per request,
`stream_options.include_usage`. Per request: TTFT, inter-token latencies (ITL), TPOT
((e2e - TTFT) / (output tokens - 1)), end-to-end latency, prompt and cached tokens
(usage.prompt_tokens_details.cached_tokens where the server reports it) and reusable tokens
(what a perfect prefix cache could have served: see kvserve.services.bench.reuse). Overall:
request and output-token throughput, goodput under --slo (requests/s meeting every SLO given),
mean / median / p99 of TTFT, TPOT, ITL and e2e, the cached and the reused fraction (cached /
prompt tokens, cached / reusable tokens).

Arrivals: Poisson at --request-rate (seeded), all at once for `inf`, the trace's own times for
`mooncake` unless a rate is given; --max-concurrency bounds the requests in flight. A comma list
of rates runs the workload once per rate, in turn.

Writes DIR/requests.jsonl (one line per request), DIR/summary.json, ttft.png, tpot.png (and
throughput_vs_rate.png for several rates); prints a table; the last line printed is the summary
as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvserve.services.bench import workloads as wl
from kvserve.services.bench.reuse import DEFAULT_BLOCK_SIZE, ReuseTracker
from kvserve.services.cli_support import CliError

NOT_RATES = ("inf", "trace")


# ---- arguments ---------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--workload", required=True, help="one of: " + ", ".join(wl.WORKLOADS))
    p.add_argument("--request-rate", default=None,
                   help="requests/s (Poisson), 'inf', or a comma list to sweep; default: inf, "
                        "or the trace's arrival times for mooncake")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--num-requests", type=int, default=None,
                   help="random: how many (default 100); other workloads: a cap")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-serve", help="output directory")
    p.add_argument("--slo", default="", help="ttft=MS,tpot=MS (either or both) for goodput")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"token ids are drawn below it (default: the server's, else "
                        f"{wl.DEFAULT_VOCAB_SIZE})")  # fmt: skip
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="output tokens per request (overrides the workload's lengths)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="short random requests sent first, not measured")  # fmt: skip
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--reuse-block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="reusable tokens are counted in whole blocks of this many (the "
                        "server's KV block size)")  # fmt: skip
    _add_workload_arguments(p)


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Each workload's own options, a group each."""
    g = p.add_argument_group("random")
    g.add_argument("--input-len", type=int, default=256)
    g.add_argument("--output-len", type=int, default=64, help="also shared-prefix, multi-round")
    g.add_argument("--range-ratio", type=float, default=0.0)
    g = p.add_argument_group("shared-prefix")
    g.add_argument("--groups", type=int, default=8)
    g.add_argument("--prompts-per-group", type=int, default=8)
    g.add_argument("--prefix-len", type=int, default=1024)
    g.add_argument("--question-len", type=int, default=64, help="also multi-round")
    g = p.add_argument_group("multi-round")
    g.add_argument("--users", type=int, default=4)
    g.add_argument("--rounds", type=int, default=4)
    g.add_argument("--system-len", type=int, default=512)
    g.add_argument("--user-context-len", type=int, default=0, help="each user's own context")
    g = p.add_argument_group("mooncake")
    g.add_argument("--trace", default=str(wl.MOONCAKE_TRACE))
    g.add_argument("--window", default="0:200", help="START:COUNT of the trace's requests")
    g.add_argument("--scale", type=int, default=8, help="lengths and block size divided by it")
    g.add_argument("--time-scale", type=float, default=8.0,
                   help="arrival times divided by it (1: as recorded)")  # fmt: skip
    g.add_argument("--max-context", type=int, default=2048, help="input + output at most")


def parse_rates(text: str | None) -> list[float] | None:
    if text is None:
        return None
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            r = math.inf if part == "inf" else float(part)
        except ValueError:
            raise CliError(f"--request-rate must be numbers or 'inf', got {text!r}") from None
        if not r > 0:
            raise CliError(f"--request-rate must be > 0, got {part}")
        rates.append(r)
    return rates


def parse_slo(text: str) -> dict[str, float]:
    slo: dict[str, float] = {}
    for part in filter(None, (s.strip() for s in text.split(","))):
        key, sep, val = part.partition("=")
        try:
            ms = float(val)
        except ValueError:
            ms = -1.0
        if not sep or key not in ("ttft", "tpot") or not ms > 0:
            raise CliError(f"--slo must be ttft=MS,tpot=MS with positive numbers, got {text!r}")
        slo[key] = ms / 1000.0
    return slo


def validate(args: argparse.Namespace) -> None:
    if args.workload not in wl.WORKLOADS:
        raise CliError(
            f"--workload must be one of {', '.join(wl.WORKLOADS)}, got {args.workload!r}"
        )
    if not args.base_url.startswith(("http://", "https://")):
        raise CliError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    positive = ("max_concurrency", "num_requests", "vocab_size", "max_tokens", "input_len",
                "output_len", "groups", "prompts_per_group", "question_len", "users", "rounds",
                "scale", "max_context", "reuse_block_size")  # fmt: skip
    for name in positive:
        v = getattr(args, name)
        if v is not None and v < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    for name in ("prefix_len", "system_len", "user_context_len", "warmup_requests"):
        if getattr(args, name) < 0:
            raise CliError(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 <= args.range_ratio < 1:
        raise CliError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if not args.time_scale > 0 or not args.timeout > 0:
        raise CliError("--time-scale and --timeout must be > 0")
    if args.vocab_size is not None and args.vocab_size <= wl.MIN_TOKEN_ID:
        raise CliError(f"--vocab-size must be > {wl.MIN_TOKEN_ID}")
    try:
        wl.parse_window(args.window)
    except ValueError as e:
        raise CliError(f"--window: {e}") from None
    if args.workload == "mooncake" and wl.MOONCAKE_BLOCK % args.scale:
        raise CliError(f"--scale must divide {wl.MOONCAKE_BLOCK}, got {args.scale}")


def build_workload(args: argparse.Namespace, vocab_size: int, run: int = 0) -> list[wl.Session]:
    """The workload of the run-th rate of a sweep: seed + run, so a later rate does not find
    the earlier rates' prompts in the server's prefix cache (same shapes, other tokens)."""
    name, seed = args.workload, args.seed + run
    if name == "random":
        n = args.num_requests or 100
        sessions = wl.random_workload(
            n, args.input_len, args.output_len, args.range_ratio, vocab_size, seed
        )
    elif name == "shared-prefix":
        sessions = wl.shared_prefix_workload(
            args.groups, args.prompts_per_group, args.prefix_len, args.question_len,
            args.output_len, vocab_size, seed,
        )  # fmt: skip
    elif name == "multi-round":
        sessions = wl.multi_round_workload(
            args.users, args.rounds, args.system_len, args.question_len, args.output_len,
            vocab_size, seed, args.user_context_len,
        )  # fmt: skip
    else:
        path = Path(args.trace)
        if not path.is_file():
            raise CliError(f"--trace: no such file {path}")
        sessions = wl.mooncake_workload(
            path, wl.parse_window(args.window), args.scale, args.time_scale, args.max_context,
            vocab_size, seed,
        )  # fmt: skip
    if args.max_tokens is not None:
        for s in sessions:
            for t in s.turns:
                t.output_len = args.max_tokens
    if args.num_requests is not None and name != "random":
        sessions = cap_requests(sessions, args.num_requests)
    return sessions


def cap_requests(sessions: list[wl.Session], n: int) -> list[wl.Session]:
    out = []
    for s in sessions:
        if n <= 0:
            break
        s.turns = s.turns[:n]
        n -= len(s.turns)
        out.append(s)
    return out


# ---- one request -------------------------------------------------------------------------------


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


async def _sse_chunks(content: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a server-sent event stream, up to `data: [DONE]`."""
    async for raw in content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class _StreamedCompletion:
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
    def __init__(self, args: argparse.Namespace, model: str, session: Any) -> None:
        self.url = args.base_url.rstrip("/")
        self.model = model
        self.http = session
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def complete(self, prompt: list[int], res: RequestResult) -> list[int] | None:
        """Streams one completion into `res`; returns the answer's token ids when the server
        sent them (vLLM's return_token_ids), else None."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": res.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        stream = _StreamedCompletion(res, time.perf_counter())
        try:
            async with self.http.post(
                self.url + "/v1/completions", json=body, headers=self.headers
            ) as resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return None
                async for chunk in _sse_chunks(resp.content):
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


# ---- one run -----------------------------------------------------------------------------------


def arrival_times(sessions: list[wl.Session], rate: float | None, seed: int) -> list[float]:
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
    sessions: list[wl.Session],
    rate: float | None,
    vocab_size: int,
) -> tuple[list[RequestResult], float]:
    """Every session started at its arrival time (at `rate`); the results in start order and
    the run's duration in seconds."""
    from tqdm import tqdm

    total = sum(s.num_requests for s in sessions)
    bar = tqdm(total=total, desc=f"rate {rate}", unit="req", disable=not sys.stderr.isatty())
    starts = arrival_times(sessions, rate, args.seed)
    run = _SessionRunner(args, client, rate, vocab_size, bar.update)
    await asyncio.gather(
        *(run.session(k, s, at) for k, (s, at) in enumerate(zip(sessions, starts, strict=True)))
    )
    duration = time.perf_counter() - run.t_start
    bar.close()
    return run.results, duration


class _SessionRunner:
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
        self.client = client
        self.rate = rate
        self.vocab_size = vocab_size
        self.progress = progress  # progress(n): n more requests done
        self.sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        self.results: list[RequestResult] = []
        self.reuse = ReuseTracker(args.reuse_block_size)
        self.t_start = time.perf_counter()

    async def request(self, prompt: list[int], res: RequestResult) -> list[int] | None:
        if self.sem is None:
            return await self._send(prompt, res)
        async with self.sem:
            return await self._send(prompt, res)

    async def _send(self, prompt: list[int], res: RequestResult) -> list[int] | None:
        res.start_s = time.perf_counter() - self.t_start
        res.reusable_tokens = self.reuse.observe(prompt)
        return await self.client.complete(prompt, res)

    async def session(self, k: int, s: wl.Session, at: float) -> None:
        delay = at - (time.perf_counter() - self.t_start)
        if delay > 0:
            await asyncio.sleep(delay)  # the conversation's arrival time
        history: list[int] = []
        for j, turn in enumerate(s.turns):
            prompt = history + turn.tokens if s.carry_history else turn.tokens
            res = RequestResult(k, s.tag, j, self.rate, len(prompt), turn.output_len)
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

    def _skip_rest(self, k: int, s: wl.Session, j: int) -> None:
        for rest in s.turns[j + 1 :]:
            skipped = RequestResult(k, s.tag, j + 1, self.rate, 0, rest.output_len)
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
            ids = wl.random_tokens(rng, res.output_tokens, self.vocab_size)
        return ids


async def warmup(args: argparse.Namespace, client: Client, vocab_size: int) -> None:
    rng = random.Random(f"warmup:{args.seed}")
    jobs = []
    for i in range(args.warmup_requests):
        res = RequestResult(i, "warmup", 0, None, 16, 4)
        jobs.append(client.complete(wl.random_tokens(rng, 16, vocab_size), res))
    await asyncio.gather(*jobs)


# ---- metrics -----------------------------------------------------------------------------------


def _stats(values: list[float], name: str) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {f"{name}_mean_s": None, f"{name}_median_s": None, f"{name}_p99_s": None}
    a = np.asarray(values, dtype=float)
    return {
        f"{name}_mean_s": float(a.mean()),
        f"{name}_median_s": float(np.median(a)),
        f"{name}_p99_s": float(np.percentile(a, 99)),
    }


def summarize(
    results: list[RequestResult], duration: float, slo: dict[str, float], rate: float | None
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    reusable = sum(r.reusable_tokens for r in ok)

    def good(r: RequestResult) -> bool:
        if "ttft" in slo and (r.ttft_s is None or r.ttft_s > slo["ttft"]):
            return False
        return not ("tpot" in slo and r.tpot_s is not None and r.tpot_s > slo["tpot"])

    n_good = sum(good(r) for r in ok)
    d = max(duration, 1e-9)
    s: dict[str, Any] = {
        "request_rate": "trace" if rate is None else ("inf" if math.isinf(rate) else rate),
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / d,
        "output_tok_s": out_tokens / d,
        "total_tok_s": (out_tokens + prompt_tokens) / d,
        "goodput": n_good / d,
        "goodput_fraction": n_good / len(results) if results else 0.0,
        "slo": {k: v * 1000.0 for k, v in slo.items()},
        "prompt_tokens_total": prompt_tokens,
        "output_tokens_total": out_tokens,
        "cached_tokens_total": cached,
        "cached_fraction": cached / prompt_tokens if prompt_tokens else 0.0,
        "cached_tokens_reported": any(r.cached_tokens is not None for r in ok),
        "reusable_tokens_total": reusable,
        "reused_fraction": cached / reusable if reusable else None,
    }
    s |= _stats([r.ttft_s for r in ok if r.ttft_s is not None], "ttft")
    s |= _stats([r.tpot_s for r in ok if r.tpot_s is not None], "tpot")
    s |= _stats([x for r in ok for x in r.itl_s], "itl")
    s |= _stats([r.e2e_s for r in ok if r.e2e_s is not None], "e2e")
    errors = sorted({r.error for r in results if r.error})
    s["errors"] = errors[:5]
    return s


def table(s: dict[str, Any]) -> str:
    def fmt(v: Any, ms: bool = False) -> str:
        if v is None:
            return "-"
        if ms:
            return f"{v * 1000:.1f}"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    rows = [
        ("request rate (req/s)", fmt(s["request_rate"])),
        ("requests: completed / failed", f"{s['completed']} / {s['failed']}"),
        ("duration (s)", fmt(s["duration_s"])),
        ("request throughput (req/s)", fmt(s["request_throughput"])),
        ("output throughput (tok/s)", fmt(s["output_tok_s"])),
        ("total throughput (tok/s)", fmt(s["total_tok_s"])),
        ("goodput (req/s)", fmt(s["goodput"])),
        ("prompt / cached tokens", f"{s['prompt_tokens_total']} / {s['cached_tokens_total']}"),
        ("reusable tokens / reused", f"{s['reusable_tokens_total']} / {fmt(s['reused_fraction'])}"),
    ]
    for m in ("ttft", "tpot", "itl", "e2e"):
        vals = [fmt(s[f"{m}_{k}_s"], ms=True) for k in ("mean", "median", "p99")]
        rows.append((f"{m.upper()} mean / median / p99 (ms)", " / ".join(vals)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def plot(out: Path, runs: list[tuple[dict[str, Any], list[RequestResult]]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for metric, label in (("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for summary, results in runs:
            vals = [getattr(r, metric) * 1000 for r in results if getattr(r, metric) is not None]
            if vals:
                ax.hist(vals, bins=30, alpha=0.6, label=f"rate {summary['request_rate']}")
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
        ax.set_title(f"{label.split()[0]} distribution")
        ax.legend()
        fig.tight_layout()
        path = out / f"{metric.split('_')[0]}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path.name)
    if len(runs) > 1:
        finite = [(s["request_rate"], s) for s, _ in runs if s["request_rate"] not in NOT_RATES]
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [float(r) for r, _ in finite]
        ax.plot(xs, [s["output_tok_s"] for _, s in finite], "o-", label="output tok/s")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("output tokens/s")
        ax2 = ax.twinx()
        ax2.plot(xs, [s["ttft_median_s"] or 0 for _, s in finite], "s--", color="C1")
        ax2.set_ylabel("median TTFT (s)", color="C1")
        ax.set_title("throughput vs request rate")
        fig.tight_layout()
        path = out / "throughput_vs_rate.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path.name)
    return written


# ---- entry -------------------------------------------------------------------------------------


async def server_model(args: argparse.Namespace, http: Any) -> tuple[str, int]:
    url = args.base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    card: dict[str, Any] = {}
    try:
        async with http.get(url, headers=headers) as resp:
            if resp.status == 200:
                data = (await resp.json()).get("data") or []
                card = data[0] if data else {}
            elif args.model is None:
                raise CliError(f"{url} answered HTTP {resp.status}; pass --model")
    except (OSError, TimeoutError, ValueError) as e:
        raise CliError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    model = args.model or card.get("id")
    if not model:
        raise CliError(f"{url} lists no model; pass --model")
    vocab = args.vocab_size or card.get("vocab_size") or wl.DEFAULT_VOCAB_SIZE
    return str(model), int(vocab)


async def _main(
    args: argparse.Namespace, rates: list[float | None], slo: dict[str, float]
) -> dict[str, Any]:
    import aiohttp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    # A connection per request: llama-server closes an idle kept-alive connection, and the next
    # request on it would fail (a local connect costs well under a millisecond).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        model, vocab = await server_model(args, http)
        try:
            sessions = build_workload(args, vocab)
        except ValueError as e:
            raise CliError(str(e)) from None
        client = Client(args, model, http)
        if args.warmup_requests:
            await warmup(args, client, vocab)
        runs = await _run_rates(args, client, sessions, rates, slo, vocab, out)
    return _write_summary(args, model, runs, out)


async def _run_rates(
    args: argparse.Namespace,
    client: Client,
    sessions: list[wl.Session],
    rates: list[float | None],
    slo: dict[str, float],
    vocab: int,
    out: Path,
) -> list[tuple[dict[str, Any], list[RequestResult]]]:
    """One run per rate (a fresh workload for each after the first): (summary, results) of
    each, every request a line of out/requests.jsonl, every summary a table on stdout."""
    runs: list[tuple[dict[str, Any], list[RequestResult]]] = []
    with open(out / "requests.jsonl", "w") as f:
        for i, rate in enumerate(rates):
            if i:
                sessions = build_workload(args, vocab, run=i)
            results, duration = await run_once(args, client, sessions, rate, vocab)
            summary = summarize(results, duration, slo, rate)
            runs.append((summary, results))
            for r in results:
                row = asdict(r)
                row["run"] = i
                row["request_rate"] = summary["request_rate"]
                f.write(json.dumps(row) + "\n")
            print(table(summary), flush=True)
    return runs


def _write_summary(
    args: argparse.Namespace,
    model: str,
    runs: list[tuple[dict[str, Any], list[RequestResult]]],
    out: Path,
) -> dict[str, Any]:
    """out/summary.json: the last run's summary, the settings, every run's (when several),
    the plots; returned as well."""
    final = dict(runs[-1][0])
    final |= {"workload": args.workload, "model": model, "base_url": args.base_url}
    final["seed"] = args.seed
    final["max_concurrency"] = args.max_concurrency
    if len(runs) > 1:
        final["runs"] = [s for s, _ in runs]
    final["plots"] = [] if args.no_plots else plot(out, runs)
    final["out"] = str(out)
    (out / "summary.json").write_text(json.dumps(final, indent=2) + "\n")
    return final


def run(args: argparse.Namespace) -> int:
    validate(args)
    rates = parse_rates(args.request_rate)
    slo = parse_slo(args.slo)
    if rates is None:
        rates_run: list[float | None] = [None if args.workload == "mooncake" else math.inf]
    else:
        rates_run = list(rates)
    final = asyncio.run(_main(args, rates_run, slo))
    print(json.dumps(final), flush=True)
    return 0
