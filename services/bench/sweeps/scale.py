"""`kvserve bench scale`: what a fleet of 2 engine workers on 2 cores gains from a shared KV
store and KV-cache-aware routing, on one machine.

Arms, `kvserve stack`s on 2 cores (with `--store-format`, no metrics ports) and a reference:
`one-worker` (1 worker of 2 threads, its own memory store), `rr-local` (2 workers of 1 thread,
round-robin, each its own memory store), `rr-shared` (the same on the shared Redis store),
`cache-shared` (the shared store, KV-cache-aware routing), `llama-server` (2 slots, 2 threads).
Workloads (`kvserve bench serve`'s): `multi-round` (--users x --rounds, as LMCache's multi-round
QA: a 256-token system prompt shared by all, a 1,024-token context of each user's own,
64-token questions, 32-token answers, each user's rounds in turn), `shared-prefix`
(4 groups x 8 prompts of 512 + 64 tokens, 32-token answers, 8 in flight), `mooncake` (--window
of the trace at its arrival times).

Each arm x workload runs on a fresh server, on an empty store (a redis-server of its own, or
`--redis URL` after FLUSHDB), once all its workers are live: unmeasured warm-up requests, the
workload, then the gateway's router totals (GET /v1/cache/stats; they count the warm-up requests).
Reported: output tok/s, TTFT p50 / p90 / mean and per round, hit rate (cached / prompt tokens),
reused fraction (cached / reusable tokens: kvserve.services.bench.lib.reuse), failed requests, the
router's mean |predicted - actual| cached tokens per request, and ratios against `one-worker`
and `rr-local`; a table per workload, then one JSON line {workload: {arm: row}}. `--out DIR`
keeps every run's files and DIR/scale.json, which `--report` prints (and plots) again.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib import arms
from kvserve.services.bench.lib.flags import add_gguf, add_plot, add_report, comma_list
from kvserve.services.bench.lib.http import gateway_stats
from kvserve.services.bench.lib.llama_cpp import ArmSetupError
from kvserve.services.bench.lib.plots import pyplot, save_figure
from kvserve.services.bench.lib.process import StartError, free_port
from kvserve.services.bench.sweeps import compare
from kvserve.services.bench.workloads.mooncake import parse_window
from kvserve.services.cli_support import CliError
from kvserve.shared.config import STORE_FORMATS

CORES = 2
LLAMA_SLOTS = 2


@dataclass(frozen=True)
class StackArm:
    workers: int
    routing: str
    worker_store: str  # shared: the Redis store; local: each worker its own memory:// store
    threads_per_worker: int


STACK_ARMS = {
    "one-worker": StackArm(1, "round-robin", "local", CORES),
    "rr-local": StackArm(2, "round-robin", "local", CORES // 2),
    "rr-shared": StackArm(2, "round-robin", "shared", CORES // 2),
    "cache-shared": StackArm(2, "cache-aware", "shared", CORES // 2),
}
ARMS = (*STACK_ARMS, "llama-server")
WORKLOADS = ("multi-round", "shared-prefix", "mooncake")
BASES = {"one-worker": "vs_one_worker", "rr-local": "vs_rr_local"}  # ratios' arms and keys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated: " + ", ".join(ARMS))
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=", ".join(WORKLOADS))
    p.add_argument("--users", type=int, default=9, help="multi-round")
    p.add_argument("--rounds", type=int, default=6, help="multi-round")
    p.add_argument("--window", default="0:60", help="mooncake: START:COUNT of the trace")
    p.add_argument("--out", default="bench-scale", metavar="DIR", help="every run's files")
    add_plot(p)
    add_report(p, "--out DIR/scale.json")
    p.add_argument("--redis", default=None,
                   help="Redis URL for the stacks; FLUSHDB before every arm x workload "
                        "(default: a redis-server started for each)")  # fmt: skip
    p.add_argument("--store-format", choices=STORE_FORMATS, default="native")
    add_gguf(p)
    p.add_argument("--warmup-requests", type=int, default=4, help="per run, not measured")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to start a server")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds for one bench run")
    p.add_argument("--router-only", action="store_true", help="only the cost of a routing decision")


def validate(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The chosen arms and workloads; CliError (one line) for a bad option."""
    chosen = (
        comma_list(args.arms, ARMS, "--arms"),
        comma_list(args.workloads, WORKLOADS, "--workloads"),
    )
    if args.users < 1 or args.rounds < 1 or args.warmup_requests < 0:
        raise CliError("--users and --rounds must be >= 1, --warmup-requests >= 0")
    try:
        parse_window(args.window)
    except ValueError as e:
        raise CliError(f"--window: {e}") from None
    return chosen


# ---- one arm x workload -------------------------------------------------------------------------


def stack_flags(arm: str, store_format: str) -> list[str]:
    s = STACK_ARMS[arm]
    return [
        "--workers", str(s.workers), "--routing", s.routing, "--worker-store", s.worker_store,
        "--threads-per-worker", str(s.threads_per_worker), "--store-format", store_format,
        "--metrics-port", "0",
    ]  # fmt: skip


def make_server(arm: str, args: argparse.Namespace, model: Path, log_dir: Path) -> arms.ArmServer:
    """The arm's server, not started; ArmSetupError when it cannot be set up."""
    port = free_port()
    settings = arms.ArmSettings(model, log_dir, CORES, args.redis, request_timeout=args.run_timeout)
    if arm == "llama-server":
        return arms.llama_server(port, settings, LLAMA_SLOTS)
    flags, n = stack_flags(arm, args.store_format), STACK_ARMS[arm].workers
    return arms.stack_server(arm, flags, port, settings, workers=n)


def serve_options(workload: str, args: argparse.Namespace) -> argparse.Namespace:
    """`compare.bench_serve`'s arguments for the workload (bench serve's options by dest)."""
    opts: dict[str, Any] = {"workload": workload}
    if workload == "multi-round":
        opts |= {"users": args.users, "rounds": args.rounds, "system_len": 256,
                 "user_context_len": 1024, "question_len": 64, "output_len": 32,
                 "max_concurrency": args.users}  # fmt: skip
    elif workload == "shared-prefix":
        opts |= {"groups": 4, "prompts_per_group": 8, "prefix_len": 512, "question_len": 64,
                 "output_len": 32, "max_concurrency": 8}  # fmt: skip
    else:
        opts |= {"window": args.window}
    opts |= {"warmup_requests": args.warmup_requests, "run_timeout": args.run_timeout}
    return argparse.Namespace(**opts)


def _flush(url: str) -> None:  # an empty store for the next arm
    import redis

    try:
        with redis.Redis.from_url(url) as client:
            client.flushdb()
    except redis.RedisError as e:
        raise ArmSetupError(f"FLUSHDB on {url}: {e}") from None


def router_stats(base_url: str) -> dict[str, Any] | None:
    """The gateway's router totals (GET /v1/cache/stats, key "router"), or None."""
    router = gateway_stats(base_url).get("router")
    return router if isinstance(router, dict) else None


def _bench(ns: argparse.Namespace, base_url: str, vocab: int, run_dir: Path) -> dict[str, Any]:
    """bench serve's summary; one with failed requests too (RunFailed for any other failure)."""
    (run_dir / "summary.json").unlink(missing_ok=True)
    try:
        return compare.bench_serve(ns, base_url, vocab, run_dir)
    except compare.RunFailed:
        saved = run_dir / "summary.json"
        if not saved.is_file():
            raise
        summary: dict[str, Any] = json.loads(saved.read_text())
        return summary


def run_cell(
    arm: str, workload: str, args: argparse.Namespace, model: Path, vocab: int, out: Path
) -> dict[str, Any]:
    """One arm x workload on a fresh server: its row, or {"error": why}."""
    run_dir = out / workload / arm
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        if args.redis and arm in STACK_ARMS:
            _flush(args.redis)
        server = make_server(arm, args, model, run_dir)
        server.start(args.ready_timeout)
    except StartError as e:
        return {"error": str(e)}
    try:
        summary = _bench(serve_options(workload, args), server.url, vocab, run_dir)
        router = router_stats(server.url) if arm in STACK_ARMS else None
    except compare.RunFailed as e:
        return {"error": str(e)}
    finally:
        server.stop()
    lines = (run_dir / "requests.jsonl").read_text().splitlines()
    return row(summary, [json.loads(line) for line in lines], router)


# ---- rows, ratios, tables -----------------------------------------------------------------------


def row(
    summary: dict[str, Any], requests: list[dict[str, Any]], router: dict[str, Any] | None
) -> dict[str, Any]:
    """An arm x workload's numbers from bench serve's summary and requests.jsonl rows."""
    import numpy as np

    ok = [r for r in requests if r["success"] and r["ttft_s"] is not None]
    ttft = np.asarray([r["ttft_s"] for r in ok], dtype=float)
    rounds = sorted({r["turn"] for r in ok})
    by_round = [float(np.mean([r["ttft_s"] for r in ok if r["turn"] == t])) for t in rounds]
    later = [r["ttft_s"] for r in ok if r["turn"] > 0]  # after the first round (warm caches)
    cached = bool(summary.get("cached_tokens_reported"))
    requests_routed = (router or {}).get("requests")
    return {
        "output_tok_s": summary["output_tok_s"],
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ok else None,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if ok else None,
        "ttft_mean_s": float(ttft.mean()) if ok else None,
        "ttft_by_round_s": by_round,
        "ttft_p90_later_rounds_s": float(np.percentile(later, 90)) if later else None,
        "hit_rate": summary.get("cached_fraction") if cached else None,
        "reused_fraction": summary.get("reused_fraction") if cached else None,
        "failed": summary["failed"],
        "num_requests": summary["num_requests"],
        "router": router,
        "router_error_per_request": _ratio((router or {}).get("abs_error_tokens"), requests_routed),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def with_ratios(cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each row with its output tok/s and p90 TTFT over those of `one-worker` and `rr-local`
    (None where either is missing)."""
    out: dict[str, dict[str, Any]] = {}
    for arm, cell in cells.items():
        out[arm] = dict(cell)
        if "error" in cell:
            continue
        for base, key in BASES.items():
            ref = cells.get(base) or {}
            out[arm][key] = {
                k: _ratio(cell.get(k), ref.get(k))
                for k in ("output_tok_s", "ttft_p90_s", "ttft_p90_later_rounds_s")
            }
    return out


def _num(v: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


TITLES = ("out tok/s", "x1w", "xrr", "TTFT p50 ms", "p90 ms", "mean ms", "p90 x1w", "p90 xrr",
          "hit", "reused", "failed", "router err tok/req")  # fmt: skip


def _line(first: str, cells: list[str]) -> str:
    widths = (max(len(t), 7) for t in TITLES)
    return f"{first:<14}" + "".join(f" {c:>{n}}" for c, n in zip(cells, widths, strict=True))


def _cells(r: dict[str, Any]) -> list[str]:
    w, rr = r.get("vs_one_worker", {}), r.get("vs_rr_local", {})
    ttft = [_num(r[k], 1e3, 0) for k in ("ttft_p50_s", "ttft_p90_s", "ttft_mean_s")]
    tok_s = [_num(r["output_tok_s"], digits=1), _num(w.get("output_tok_s")),
             _num(rr.get("output_tok_s"))]  # fmt: skip
    rest = [_num(r["hit_rate"]), _num(r["reused_fraction"]), str(r["failed"])]
    p90 = [_num(w.get("ttft_p90_s")), _num(rr.get("ttft_p90_s"))]
    return [*tok_s, *ttft, *p90, *rest, _num(r["router_error_per_request"], digits=1)]


def table(workload: str, rows: dict[str, dict[str, Any]]) -> str:
    """Ratios: x1w against one-worker, xrr against rr-local (tok/s, then p90 TTFT)."""
    head = _line("arm", list(TITLES))
    lines = [f"== {workload}", head, "-" * len(head)]
    for arm, r in rows.items():
        if "error" in r:
            lines.append(f"{arm:<14}  not run: {r['error'].splitlines()[0]}")
        else:
            lines.append(_line(arm, _cells(r)))
    return "\n".join(lines + _round_lines(rows))


def _round_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Per round: mean TTFT, then the p90 TTFT of the rounds after the first (x rr-local)."""
    ok = {a: r for a, r in rows.items() if len(r.get("ttft_by_round_s", [])) > 1}
    if not ok:
        return []
    return ["mean TTFT per round (ms) | p90 TTFT after round 1 (ms, x rr-local):"] + [
        f"  {arm:<12} "
        + " ".join(_num(t, 1e3, 0) for t in r["ttft_by_round_s"])
        + f" | {_num(r.get('ttft_p90_later_rounds_s'), 1e3, 0)}"
        + f" ({_num(r.get('vs_rr_local', {}).get('ttft_p90_later_rounds_s'))})"
        for arm, r in ok.items()
    ]


def save_plot(path: Path, report: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Two panels, a group of bars per workload and a bar per arm: output tok/s, p90 TTFT."""
    names = list(dict.fromkeys(arm for rows in report.values() for arm in rows))
    width = 0.8 / max(1, len(names))
    fig, panels = pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, key, label in zip(panels, ("output_tok_s", "ttft_p90_s"),
                              ("output tokens/s", "p90 TTFT (s)"), strict=True):  # fmt: skip
        for i, arm in enumerate(names):
            values = [(rows.get(arm) or {}).get(key) or 0.0 for rows in report.values()]
            xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(report))]
            ax.bar(xs, values, width, label=arm, color=f"C{i}")
        ax.set_xticks(list(range(len(report))), list(report))
        ax.set_ylabel(label)
    panels[0].legend(fontsize=8)
    fig.suptitle(f"kvserve bench scale: 2 workers on {CORES} cores")
    save_figure(fig, path)


# ---- entry --------------------------------------------------------------------------------------


def _finish(args: argparse.Namespace, results: dict[str, dict[str, dict[str, Any]]]) -> int:
    report = {w: with_ratios(cells) for w, cells in results.items()}
    for workload, rows in report.items():
        print(table(workload, rows), flush=True)
    if args.plot:
        save_plot(Path(args.plot), report)
    print(json.dumps(report), flush=True)
    ran = any("error" not in r for rows in report.values() for r in rows.values())
    return 0 if ran else 1


def _run_all(
    args: argparse.Namespace, chosen: tuple[list[str], list[str]], out: Path
) -> dict[str, dict[str, dict[str, Any]]]:
    from kvserve.shared.config import default_model_path

    model = args.gguf or default_model_path()
    vocab = arms.model_vocab(model)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in chosen[1]:
        for arm in chosen[0]:
            cell = run_cell(arm, workload, args, model, vocab, out)
            note = cell["error"].splitlines()[0] if "error" in cell else "done"
            print(f"[{arm} / {workload}] {note}", flush=True)
            results.setdefault(workload, {})[arm] = cell
            # After every run, so that a run stopped part-way keeps the others for --report.
            (out / "scale.json").write_text(json.dumps({"results": results}, indent=2) + "\n")
    return results


def _router_cost() -> dict[str, Any]:
    from kvserve.services.bench.sweeps.router_cost import measure

    cost = measure()
    print(
        f"router: {cost['us_median']:.0f} us per decision (p99 {cost['us_p99']:.0f} us), "
        f"{cost['workers']} workers x {cost['blocks_per_worker']} blocks, "
        f"{cost['prompt_tokens']}-token prompts",
        flush=True,
    )
    return cost


def run(args: argparse.Namespace) -> int:
    chosen = validate(args)
    if args.router_only:
        print(json.dumps({"router": _router_cost()}), flush=True)
        return 0
    if args.report:
        saved = Path(args.out) / "scale.json"
        if not saved.is_file():
            raise CliError(f"--report: no {saved}")
        return _finish(args, json.loads(saved.read_text())["results"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    _router_cost()
    return _finish(args, _run_all(args, chosen, Path(args.out)))
