"""`kvserve bench compare --workload NAME [workload options] [--arms A,B,...] [--repeats 3]`:
the same `kvserve bench serve` workload against kvserve and the servers a user would pick instead,
on the same GGUF file, the arms in turn within each repeat (A B C, A B C, ...) so that the
machine's drift over a run falls on every arm alike.

Arms (see kvserve.services.bench.lib.arms): `kvserve` (`kvserve serve --store memory://`: the
GGUF's own quantized weights), `kvserve-fp32` (the same with `--weights fp32`: the weights
expanded to fp32), `kvserve-bf16` (`--weights bf16`: bf16 matmuls), `kvserve-disagg`
(`kvserve stack` on a local redis-server the harness starts as compose.yaml does, or on
`--redis URL`),
`llama-server` (llama.cpp, built on demand into the cache dir; 8 slots x 2,048 tokens, continuous
batching, prompt cache on) and `hf` (transformers behind a minimal OpenAI shim); and, only when
named in --arms, `kvserve-spec` (`kvserve serve --speculative ngram --num-speculative-tokens K`,
K from --num-speculative-tokens; not run, with the reason, where `kvserve serve` has no such
option) and `kvserve-sync` (`kvserve serve --no-async-scheduling`: steps not overlapped). The
pinned llama-server has no n-gram speculative decoding (only a draft model's), so no arm of it.
Every repeat
starts the arm's server fresh (so no repeat finds the previous one's prompts cached), sends
`--warmup-requests` short requests that are not measured, runs `kvserve bench serve` as a
subprocess and stops the server. Same tokens (the vocabulary comes from the GGUF, not
from each server; the chat workloads' prompts are rendered with the GGUF's own tokenizer and chat
template), greedy, EOS ignored, same thread count.

Reports per arm the median over repeats of output tok/s, mean, median and p99 TTFT, mean TPOT,
with their range; an arm that cannot be set up is reported with the reason and the others run.
The last stdout line is one JSON object keyed by arm; `--plot PATH` draws the arms side by side;
`--report` prints and plots the results a run left in --out without running anything. Workload
options are `kvserve bench serve`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib import arms
from kvserve.services.bench.lib.flags import add_gguf, add_plot, add_report
from kvserve.services.bench.lib.plots import pyplot, save_figure
from kvserve.services.bench.lib.process import StartError, free_port, kvserve_command

KEYS = ("output_tok_s", "ttft_mean_s", "ttft_median_s", "ttft_p99_s", "tpot_mean_s")
# `kvserve bench serve` options the harness sets itself rather than passing through.
OWN_OPTIONS = {"help", "base_url", "out", "model", "api_key", "vocab_size", "warmup_requests",
               "tokenizer"}  # fmt: skip


def _serve_actions() -> list[argparse.Action]:
    from kvserve.services.bench import serve

    tmp = argparse.ArgumentParser(add_help=False)
    serve.add_arguments(tmp)
    return [a for a in tmp._actions if a.dest not in OWN_OPTIONS]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--arms",
        default=",".join(arms.DEFAULT_ARMS),
        help="comma-separated, of: "
        + ", ".join(arms.ARMS)
        + " (default: all but kvserve-spec and kvserve-sync)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench-compare", help="output directory")
    add_gguf(p)
    p.add_argument("--threads", type=int, default=2, help="threads every server may use")
    p.add_argument("--warmup-requests", type=int, default=4, help="per repeat, not measured")
    p.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds for a server to start"
    )
    p.add_argument("--run-timeout", type=float, default=7200.0, help="seconds for one bench run")
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=arms.SPECULATIVE_TOKENS,
        help="kvserve-spec: tokens the n-gram lookup proposes per step",
    )
    p.add_argument(
        "--redis",
        default=None,
        help="Redis URL for kvserve-disagg (default: a redis-server started for it on a free port)",
    )
    p.add_argument(
        "--redis-maxmemory",
        default=arms.DISAGG_REDIS_MAXMEMORY,
        help="maxmemory of that redis-server (allkeys-lru, as compose.yaml)",
    )
    add_plot(p)
    add_report(p, "the results already in --out DIR/compare.json")
    g = p.add_argument_group("workload (passed to `kvserve bench serve`)")
    for action in _serve_actions():
        g._add_action(action)


def serve_argv(args: argparse.Namespace) -> list[str]:
    """The pass-through options back as a command line (those left at their default omitted)."""
    argv: list[str] = []
    for action in _serve_actions():
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def run_repeat(
    arm: str, r: int, args: argparse.Namespace, model: Path, vocab: int, out: Path
) -> dict[str, Any]:
    """Repeat `r` of one arm on a fresh server: its summary. StartError or RunFailed when it
    does not count."""
    server = _start_server(arm, args, model, out, r)
    try:
        summary = bench_serve(args, server.url, vocab, out / arm / f"repeat-{r}", model)
    finally:
        server.stop()
    print(
        f"[{arm}] repeat {r + 1}: " + ", ".join(f"{k}={summary.get(k)}" for k in KEYS),
        flush=True,
    )
    return summary


class RunFailed(Exception):
    """Why a repeat does not count."""


def _start_server(
    arm: str, args: argparse.Namespace, model: Path, out: Path, r: int
) -> arms.ArmServer:
    """The arm's server for repeat `r`, ready; StartError when it cannot start."""
    settings = arms.ArmSettings(
        model, out / arm, args.threads, args.redis, args.redis_maxmemory,
        args.timeout + 60,  # the client's limit is the one that applies
        args.num_speculative_tokens,
    )  # fmt: skip
    server = arms.make_server(arm, free_port(), settings)
    t0 = time.monotonic()
    server.start(args.ready_timeout)
    print(
        f"[{arm}] repeat {r + 1}/{args.repeats}: ready in {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    return server


def bench_serve(
    args: argparse.Namespace, base_url: str, vocab: int, run_dir: Path, model: Path | None = None
) -> dict[str, Any]:
    """`kvserve bench serve` against the server, the chat workloads' prompts made with `model`'s
    tokenizer: its summary (its output in run_dir/stdout.txt); RunFailed when it fails, times
    out, or a request failed."""
    cmd = [*kvserve_command(), "bench", "serve", "--base-url", base_url, *serve_argv(args)]
    cmd += ["--vocab-size", str(vocab), "--out", str(run_dir)]
    if model is not None:
        cmd += ["--tokenizer", str(model)]
    cmd += ["--warmup-requests", str(args.warmup_requests)]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.run_timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise RunFailed(f"bench serve ran past {args.run_timeout:.0f} s") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "stdout.txt").write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RunFailed(f"bench serve exited with {proc.returncode}:\n{tail}")
    summary: dict[str, Any] = json.loads(lines[-1])
    if (why := failed_run(summary)) is not None:
        raise RunFailed(why)
    return summary


def failed_run(summary: dict[str, Any]) -> str | None:
    """Why a run does not count (some request failed: its throughput would mislead), or None."""
    failed = int(summary.get("failed") or 0)
    if not failed:
        return None
    errors = summary.get("errors") or ["no reason given"]
    return f"{failed} of {summary.get('num_requests')} requests failed, e.g. {errors[0]}"


def aggregate(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over the repeats with [min, max] ranges; an error stays an error."""
    if "error" in result:
        return {"error": result["error"], "repeats_done": len(result.get("runs", []))}
    runs = result["runs"]
    row: dict[str, Any] = {}
    ranges: dict[str, list[float]] = {}
    for key in KEYS:
        values = [float(s[key]) for s in runs if s.get(key) is not None]
        row[key] = statistics.median(values) if values else None
        ranges[key] = [min(values), max(values)] if values else []
    row["range"] = ranges
    row["repeats"] = len(runs)
    return row


def _cell(row: dict[str, Any], key: str, width: int) -> str:
    v, rng = row[key], row["range"][key]
    text = "-" if v is None else f"{v:.3g} [{rng[0]:.3g}-{rng[1]:.3g}]"
    return f" {text:>{width}}"


def table(rows: dict[str, dict[str, Any]]) -> str:
    widths = (22, 24, 24, 22, 24)
    titles = ("out tok/s", "TTFT mean s", "TTFT median s", "TTFT p99 s", "TPOT mean s")
    head = f"{'arm':<16}" + "".join(f" {t:>{w}}" for t, w in zip(titles, widths, strict=True))
    lines = [head, "-" * len(head)]
    for arm, row in rows.items():
        if "error" in row:
            lines.append(f"{arm:<16}  not run: {row['error'].splitlines()[0]}")
        else:
            cells = (_cell(row, k, w) for k, w in zip(KEYS, widths, strict=True))
            lines.append(f"{arm:<16}" + "".join(cells))
    return "\n".join(lines)


def save_plot(path: Path, rows: dict[str, dict[str, Any]], title: str) -> None:
    """Two panels: output tok/s per arm, and TTFT median (bar) and p99 (marker), each median
    over the repeats with its range as an error bar."""
    ok = {arm: r for arm, r in rows.items() if "error" not in r}
    names = list(ok)
    xs = range(len(names))
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(10, 4))
    _bars(left, ok, "output_tok_s", color="C0")
    left.set_ylabel("output tokens/s (median of repeats)")
    _bars(right, ok, "ttft_median_s", color="C1", label="median TTFT")
    right.scatter(xs, [ok[a]["ttft_p99_s"] or 0.0 for a in names], color="C3", label="p99 TTFT")
    right.set_ylabel("TTFT (s)")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(list(xs), names, rotation=15)
    fig.suptitle(title)
    save_figure(fig, path)


def _bars(ax: Any, ok: dict[str, dict[str, Any]], key: str, **kw: Any) -> None:
    """A bar per arm at its median with its [min, max] range as the error bar."""
    names = list(ok)
    mid = [ok[a][key] or 0.0 for a in names]
    lo = [m - (ok[a]["range"][key] or [m])[0] for m, a in zip(mid, names, strict=True)]
    hi = [(ok[a]["range"][key] or [m, m])[-1] - m for m, a in zip(mid, names, strict=True)]
    ax.bar(range(len(names)), mid, yerr=[lo, hi], capsize=4, **kw)


def _finish(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> int:
    print(table(rows), flush=True)
    if args.plot:
        save_plot(Path(args.plot), rows, f"kvserve bench compare --workload {args.workload}")
    print(json.dumps(rows), flush=True)
    return 0 if any("error" not in r for r in rows.values()) else 1


def _report(args: argparse.Namespace) -> int:
    saved = Path(args.out) / "compare.json"
    if not saved.is_file():
        print(f"--report: no {saved}", file=sys.stderr)
        return 2
    raw = json.loads(saved.read_text())["raw"]
    return _finish(args, {arm: aggregate(r) for arm, r in raw.items()})


def _run_arms(args: argparse.Namespace, chosen: list[str]) -> dict[str, dict[str, Any]]:
    """Every chosen arm in turn, repeat after repeat; the rows so far saved in --out after
    each run. An arm that fails once is not run again."""
    from kvserve.shared.config import default_model_path

    model = args.gguf or default_model_path()
    vocab = arms.model_vocab(model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {arm: {"runs": []} for arm in chosen}
    for r in range(args.repeats):
        for arm in chosen:
            result = results[arm]
            if "error" in result:
                continue
            try:
                result["runs"].append(run_repeat(arm, r, args, model, vocab, out))
            except (StartError, RunFailed) as e:
                result["error"] = str(e)
                print(f"[{arm}] could not run: {e}", flush=True)
            # After every run, so that a run stopped part-way keeps (and --report shows) the
            # others.
            done = {a: res for a, res in results.items() if res["runs"] or "error" in res}
            rows = {a: aggregate(res) for a, res in done.items()}
            raw = json.dumps({"arms": rows, "raw": done}, indent=2) + "\n"
            (out / "compare.json").write_text(raw)
    return {arm: aggregate(res) for arm, res in results.items()}


def run(args: argparse.Namespace) -> int:
    if args.report:
        return _report(args)
    chosen = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in chosen if a not in arms.ARMS]
    if unknown:
        print(
            f"unknown arms: {', '.join(unknown)}; choose from {', '.join(arms.ARMS)}",
            file=sys.stderr,
        )
        return 2
    return _finish(args, _run_arms(args, chosen))
