"""`kvserve bench serve`: the serving benchmark, an HTTP client of any OpenAI-compatible server.

Streaming /v1/completions requests with the prompt as token ids (every server sees the same
tokens), greedy (temperature 0), `ignore_eos` and a fixed `max_tokens` per request,
`stream_options.include_usage`. Per request: TTFT, inter-token latencies (ITL), TPOT
((e2e - TTFT) / (output tokens - 1)), end-to-end latency, prompt and cached tokens
(usage.prompt_tokens_details.cached_tokens where the server reports it) and reusable tokens
(what a perfect prefix cache could have served: see kvserve.services.bench.lib.reuse). Overall:
request and output-token throughput, goodput under --slo (requests/s meeting every SLO given),
mean / median / p99 of TTFT, TPOT, ITL and e2e, the cached and the reused fraction (cached /
prompt tokens, cached / reusable tokens). From the server's /metrics, read before and after each
run (a server without them reports none): speculative decoding's draft tokens, the acceptance
rate (accepted / drafted) and the mean drafts accepted per verification step.

Arrivals: Poisson at --request-rate (seeded), all at once for `inf`, the trace's own times for
`mooncake` unless a rate is given; --max-concurrency bounds the requests in flight. A comma list
of rates runs the workload once per rate, in turn.

--send-user: each request carries its session's user key as the OpenAI `user` (what a
session-affinity router routes by). --slowdown S: the server runs S times slower than the time
it models (simulated workers); arrivals are stretched by S in wall time and every duration is
divided by S, so everything recorded is modelled time (--timeout stays in wall seconds).

Writes DIR/requests.jsonl (one line per request), DIR/summary.json, ttft.png, tpot.png (and
throughput_vs_rate.png for several rates); prints a table; the last line printed is the summary
as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.services.bench.lib.completions import Client, RequestResult
from kvserve.services.bench.lib.reuse import DEFAULT_BLOCK_SIZE
from kvserve.services.bench.serve_report import (
    plot,
    spec_counters,
    spec_decode,
    summarize,
    table,
)
from kvserve.services.bench.serve_sessions import run_once, warmup
from kvserve.services.bench.workloads.chat import CopyEdit, OpenEnded
from kvserve.services.bench.workloads.mooncake import (
    MOONCAKE_BLOCK,
    MOONCAKE_TRACE,
    MooncakeTrace,
    parse_window,
)
from kvserve.services.bench.workloads.sessions import (
    WORKLOADS,
    Agentic,
    MultiRound,
    MultiTenant,
    RandomLengths,
    Session,
    SharedPrefix,
    Workload,
)
from kvserve.services.bench.workloads.tokens import DEFAULT_VOCAB_SIZE, MIN_TOKEN_ID
from kvserve.services.cli_support import CliError

if TYPE_CHECKING:
    from kvserve.shared.model.tokenizer import KVTokenizer

# ---- arguments ---------------------------------------------------------------------------------

OUTPUT_LEN = 64  # --output-len's default
CHAT_OUTPUT_LEN = 192  # copy-edit's and open-ended's: a single user's answer
CHAT_REQUESTS = 16  # copy-edit's and open-ended's --num-requests
COUNTED = ("random", "copy-edit", "open-ended")  # --num-requests is their count, not a cap


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--workload", required=True, help="one of: " + ", ".join(WORKLOADS))
    p.add_argument("--request-rate", default=None,
                   help="requests/s (Poisson), 'inf', or a comma list to sweep; default: inf, "
                        "or the trace's arrival times for mooncake")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--num-requests", type=int, default=None,
                   help="random, copy-edit, open-ended: how many (default 100, 16, 16); other "
                        "workloads: a cap")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-serve", help="output directory")
    p.add_argument("--slo", default="", help="ttft=MS,tpot=MS (either or both) for goodput")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"token ids are drawn below it (default: the server's, else "
                        f"{DEFAULT_VOCAB_SIZE})")  # fmt: skip
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="output tokens per request (overrides the workload's lengths)",
    )
    p.add_argument("--timeout", type=float, default=600.0,
                   help="wall seconds per request (not divided by --slowdown)")  # fmt: skip
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="short random requests sent first, not measured")  # fmt: skip
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--reuse-block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="reusable tokens are counted in whole blocks of this many (the "
                        "server's KV block size)")  # fmt: skip
    p.add_argument("--send-user", action="store_true",
                   help="send each session's user key as the OpenAI `user`")  # fmt: skip
    p.add_argument("--slowdown", type=float, default=1.0,
                   help="the server runs this many times slower than the time it models: "
                        "arrivals stretched, durations divided by it (>= 1)")  # fmt: skip
    _add_workload_arguments(p)


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Each workload's own options, a group each."""
    g = p.add_argument_group("random")
    g.add_argument("--input-len", type=int, default=256)
    g.add_argument("--output-len", type=int, default=None,
                   help=f"default {OUTPUT_LEN}, {CHAT_OUTPUT_LEN} for copy-edit and open-ended; "
                        "also every other workload but mooncake")  # fmt: skip
    g.add_argument("--range-ratio", type=float, default=0.0)
    g = p.add_argument_group("shared-prefix")
    g.add_argument("--groups", type=int, default=8)
    g.add_argument("--prompts-per-group", type=int, default=8)
    g.add_argument("--prefix-len", type=int, default=1024)
    g.add_argument("--question-len", type=int, default=64, help="also multi-round, multi-tenant")
    g = p.add_argument_group("multi-round")
    g.add_argument("--users", type=int, default=4)
    g.add_argument("--rounds", type=int, default=4)
    g.add_argument("--system-len", type=int, default=512, help="also agentic")
    g.add_argument("--user-context-len", type=int, default=0, help="each user's own context")
    g = p.add_argument_group("multi-tenant")
    g.add_argument("--tenants", type=int, default=8)
    g.add_argument("--context-len", type=int, default=2048, help="each tenant's shared context")
    g.add_argument("--users-per-tenant", type=int, default=4)
    g.add_argument("--queries-per-user", type=int, default=4)
    g = p.add_argument_group("agentic")
    g.add_argument("--agents", type=int, default=8)
    g.add_argument("--turns", type=int, default=10)
    g.add_argument("--task-len", type=int, default=256, help="each agent's own, in turn 0")
    g.add_argument("--tool-output-len", type=int, default=256, help="appended by each later turn")
    g = p.add_argument_group("mooncake")
    g.add_argument("--trace", default=str(MOONCAKE_TRACE))
    g.add_argument("--window", default="0:200", help="START:COUNT of the trace's requests")
    g.add_argument("--scale", type=int, default=8, help="lengths and block size divided by it")
    g.add_argument("--time-scale", type=float, default=8.0,
                   help="arrival times divided by it (1: as recorded)")  # fmt: skip
    g.add_argument("--max-context", type=int, default=2048, help="input + output at most")
    g = p.add_argument_group("copy-edit, open-ended")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="GGUF file or HF dir whose chat template and tokenizer make the prompts: "
                        "the served model's (default: the default model)")  # fmt: skip


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
    if args.workload not in WORKLOADS:
        raise CliError(f"--workload must be one of {', '.join(WORKLOADS)}, got {args.workload!r}")
    if not args.base_url.startswith(("http://", "https://")):
        raise CliError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    _check_counts(args)
    if not 0 <= args.range_ratio < 1:
        raise CliError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if not args.time_scale > 0 or not args.timeout > 0:
        raise CliError("--time-scale and --timeout must be > 0")
    if not args.slowdown >= 1:  # also refuses nan
        raise CliError(f"--slowdown must be >= 1, got {args.slowdown}")
    if args.vocab_size is not None and args.vocab_size <= MIN_TOKEN_ID:
        raise CliError(f"--vocab-size must be > {MIN_TOKEN_ID}")
    try:
        parse_window(args.window)
    except ValueError as e:
        raise CliError(f"--window: {e}") from None
    if args.workload == "mooncake" and MOONCAKE_BLOCK % args.scale:
        raise CliError(f"--scale must divide {MOONCAKE_BLOCK}, got {args.scale}")


def _check_counts(args: argparse.Namespace) -> None:
    """Counts and lengths: CliError unless each is >= 1 (or >= 0 where it may be empty)."""
    positive = ("max_concurrency", "num_requests", "vocab_size", "max_tokens", "input_len",
                "output_len", "groups", "prompts_per_group", "question_len", "users", "rounds",
                "tenants", "users_per_tenant", "queries_per_user", "agents", "turns", "task_len",
                "tool_output_len", "scale", "max_context", "reuse_block_size")  # fmt: skip
    for name in positive:
        v = getattr(args, name)
        if v is not None and v < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    for name in ("prefix_len", "system_len", "user_context_len", "context_len", "warmup_requests"):
        if getattr(args, name) < 0:
            raise CliError(f"--{name.replace('_', '-')} must be >= 0")


def workload_spec(args: argparse.Namespace) -> Workload:
    """The --workload's spec from its options (see workloads/)."""
    out = args.output_len or OUTPUT_LEN
    if args.workload == "random":
        return RandomLengths(args.num_requests or 100, args.input_len, out, args.range_ratio)
    if args.workload == "shared-prefix":
        return SharedPrefix(args.groups, args.prompts_per_group, args.prefix_len,
                            args.question_len, out)  # fmt: skip
    if args.workload == "multi-round":
        return MultiRound(args.users, args.rounds, args.system_len, args.question_len,
                          out, args.user_context_len)  # fmt: skip
    if args.workload == "multi-tenant":
        return MultiTenant(args.tenants, args.users_per_tenant, args.queries_per_user,
                           args.context_len, args.question_len, out)  # fmt: skip
    if args.workload == "agentic":
        return Agentic(args.agents, args.turns, args.system_len, args.task_len,
                       args.tool_output_len, out)  # fmt: skip
    if args.workload in ("copy-edit", "open-ended"):
        chat = CopyEdit if args.workload == "copy-edit" else OpenEnded
        n = args.num_requests or CHAT_REQUESTS
        return chat(n, args.output_len or CHAT_OUTPUT_LEN, chat_tokenizer(args.tokenizer))
    path = Path(args.trace)
    if not path.is_file():
        raise CliError(f"--trace: no such file {path}")
    return MooncakeTrace(path, parse_window(args.window), args.scale, args.time_scale,
                         args.max_context)  # fmt: skip


def chat_tokenizer(path: str | None) -> KVTokenizer:
    """The tokenizer of `path` (None: the default model); CliError when there is none."""
    from kvserve.shared.config import default_model_path
    from kvserve.shared.model.tokenizer import KVTokenizer

    where = Path(path) if path else default_model_path()
    if not where.exists():
        raise CliError(f"--tokenizer: no such file or directory {where}")
    return KVTokenizer.from_path(where)


def build_workload(args: argparse.Namespace, vocab_size: int, run: int = 0) -> list[Session]:
    """The workload of the run-th rate of a sweep: seed + run, so a later rate does not find
    the earlier rates' prompts in the server's prefix cache (same shapes, other tokens)."""
    sessions = workload_spec(args).sessions(vocab_size, args.seed + run)
    if args.max_tokens is not None:
        for s in sessions:
            for t in s.turns:
                t.output_len = args.max_tokens
    if args.num_requests is not None and args.workload not in COUNTED:
        sessions = cap_requests(sessions, args.num_requests)
    return sessions


def cap_requests(sessions: list[Session], n: int) -> list[Session]:
    out = []
    for s in sessions:
        if n <= 0:
            break
        s.turns = s.turns[:n]
        n -= len(s.turns)
        out.append(s)
    return out


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
    vocab = args.vocab_size or card.get("vocab_size") or DEFAULT_VOCAB_SIZE
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
    sessions: list[Session],
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
            before = await server_counters(client)
            results, duration = await run_once(args, client, sessions, rate, vocab)
            summary = summarize(results, duration, slo, rate)
            summary |= spec_decode(before, await server_counters(client))
            runs.append((summary, results))
            for r in results:
                row = asdict(r)
                row["run"] = i
                row["request_rate"] = summary["request_rate"]
                f.write(json.dumps(row) + "\n")
            print(table(summary), flush=True)
    return runs


async def server_counters(client: Client) -> dict[str, float] | None:
    """The server's speculative decoding counters from its /metrics (None: no /metrics, or
    none of them there)."""
    import aiohttp

    try:
        async with client.http.get(client.url + "/metrics", headers=client.headers) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (OSError, TimeoutError, aiohttp.ClientError):
        return None
    try:
        return spec_counters(text)
    except ValueError:  # not Prometheus text
        return None


def _write_summary(
    args: argparse.Namespace,
    model: str,
    runs: list[tuple[dict[str, Any], list[RequestResult]]],
    out: Path,
) -> dict[str, Any]:
    """out/summary.json: the last run's summary, the settings (the slowdown among them: the
    figures are in modelled time), every run's (when several), the plots; returned as well."""
    final = dict(runs[-1][0])
    final |= {"workload": args.workload, "model": model, "base_url": args.base_url}
    final["seed"] = args.seed
    final["max_concurrency"] = args.max_concurrency
    final["slowdown"] = args.slowdown
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
