"""`kvserve bench startup`: how long kvserve takes to start, and where the time goes.

- generate: `kvserve generate PROMPT --timings` in a new process, from the spawn to its exit.
  Parts: interpreter (spawn to the command's handler: Python, the CLI), imports (torch, the
  engine), the engine's own parts (model_read: GGUF read and dequantization; tokenizer;
  kernel_load; weight_packing; kv_cache: allocation, population lazy), first_step (the prompt
  to its first token), rest (the other tokens), exit (the last token to the process's end).
- serve: `kvserve serve --port P` from the spawn until GET /ready answers 200, polled every
  10 ms. Parts: listening (the HTTP server is up, /health answers), the engine's parts (as
  logged in its "ready" event; the KV cache populates in the background), ready.

Each runs --repeats times, one after the other, on an otherwise idle machine; the medians are
printed against the targets (generate <= 5 s, serve ready <= 10 s) and the last line is one JSON
object with every run. The kernels are not built here: run set-up first (a missing library would
be built by the first run, which this benchmark reports as kernel_load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.flags import add_model
from kvserve.services.bench.lib.host import describe_cpu
from kvserve.services.bench.lib.process import free_port, kvserve_command, kvserve_process
from kvserve.services.bench.lib.readiness import answers_ok
from kvserve.services.cli_support import CliError

TARGETS_S = {"generate": 5.0, "serve": 10.0}
ENGINE_PARTS = ("model_read", "tokenizer", "kernel_load", "weight_packing", "kv_cache", "store")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p, help="GGUF file or HF dir")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts", default="generate,serve", help="comma-separated: generate,serve")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--out", default=None, metavar="DIR", help="also write DIR/startup.json")


def time_generate(args: argparse.Namespace) -> dict[str, float]:
    cmd = [*kvserve_command(), "generate", args.prompt, "--model", args.model]
    cmd += ["--max-tokens", str(args.max_tokens), "--timings"]
    spawned = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"kvserve generate failed ({done.returncode}): {done.stderr[-2000:]}")
    line = next(x for x in done.stderr.splitlines() if x.startswith('{"timings"'))
    t = json.loads(line)["timings"]
    engine = t["engine_s"]
    parts = {
        "interpreter": t["handler_at"] - spawned,
        "imports": t["imports_s"],
        **{k: engine[k] for k in ENGINE_PARTS if k in engine},
        "first_step": t["first_step_s"],
        "rest": t["rest_s"],
        "exit": ended - t["done_at"],
    }
    return {**parts, "total": ended - spawned}


def time_serve(args: argparse.Namespace, log: Path) -> dict[str, float]:
    """Spawn to /ready answering 200 (polled every 10 ms), and when /health first answered;
    the engine's parts from its ready event."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log.unlink(missing_ok=True)
    server = kvserve_process(["serve"], ["--port", str(port), "--model", args.model], log=log)
    spawned = time.time()
    server.spawn()
    listening = None
    try:
        while not answers_ok(base + "/ready", timeout=1):
            if listening is None and answers_ok(base + "/health", timeout=1):
                listening = time.time() - spawned
            if not server.running or time.time() - spawned > args.timeout:
                raise RuntimeError(f"kvserve serve did not get ready; log {log}")
            time.sleep(0.01)
        ready = time.time() - spawned
    finally:
        server.stop(grace=60)
    engine = next(e for e in server.events() if e.get("event") == "ready")["startup_s"]
    return {
        "listening": listening if listening is not None else ready,
        **{k: engine[k] for k in ENGINE_PARTS if k in engine},
        "total": ready,
    }


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def report(name: str, runs: list[dict[str, float]]) -> str:
    med = medians(runs)
    target = TARGETS_S[name]
    totals = ", ".join(f"{r['total']:.2f}" for r in runs)
    lines = [f"{name}: {med['total']:.2f} s median (runs {totals}); target <= {target:.0f} s: "
             + ("met" if med["total"] <= target else "NOT met")]  # fmt: skip
    lines += [f"  {k:<15} {v * 1000:8.0f} ms" for k, v in med.items() if k != "total"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(TARGETS_S)
    if unknown or args.repeats < 1:
        problem = f"--parts: unknown {sorted(unknown)}" if unknown else "--repeats must be >= 1"
        raise CliError(problem)
    out = Path(args.out) if args.out else None
    log_dir = out or Path(os.environ.get("TMPDIR", "/tmp"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {describe_cpu()}")
    results: dict[str, Any] = {"machine": describe_cpu()}
    for name in parts:
        runs = [
            time_generate(args) if name == "generate" else time_serve(args, log_dir / "serve.log")
            for _ in range(args.repeats)
        ]
        print(report(name, runs))
        results[name] = {"runs": runs, "median": medians(runs), "target_s": TARGETS_S[name]}
    if out is not None:
        (out / "startup.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results))
    return 0
