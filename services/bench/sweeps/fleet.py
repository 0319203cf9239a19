"""`kvserve bench fleet`: what KV-cache-aware routing buys a fleet, arm against arm, at the scale
a fleet runs at: N engine workers behind the real gateway and router, on a redis-server the
harness starts, driven by `kvserve bench serve` at each QPS of a sweep.

Arms (the gateway's `--routing`): `random`, `round-robin`, `least-load`, `session` (sticky by
the request's user, vLLM production-stack's baseline) and `cache-aware` (default weights);
`cache-aware@W:C` is cache-aware with overlap weight W and store cost C (a weight sweep lists
several). Workloads (bench serve's, with their shape flags): `multi-tenant`, `multi-round`,
`agentic`, `mooncake`. Workers are real (`kvserve worker`) or, with `--simulate PROFILE`,
simulated in one `kvserve sim-fleet` process at `--time-scale S`: the client then runs S times
slower and reports modelled time (bench serve --slowdown S).

Every arm x worker count x QPS is a fresh deployment (empty caches and store). Per run: TTFT
p50 / p90 / p99, TPOT, output tok/s, hit rate, reused fraction of the reusable tokens, queue
depth, the router's prediction error, decision time, KV events per second and lag, Redis
commands and bytes per second, the gateway's CPU per request. `--validate` runs the workload
with real and with simulated workers at each worker count and prints each metric's relative
error. The last line is one JSON object: each arm's runs under its name, and for --validate
the errors under keys ending in `_err`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.flags import add_gguf
from kvserve.services.bench.lib.fleet_deploy import (
    Counters,
    Deployment,
    Observer,
    Routing,
    Workers,
)
from kvserve.services.bench.lib.http import gateway_stats
from kvserve.services.bench.lib.process import StartError, run_bench_serve
from kvserve.services.bench.sweeps import fleet_report as report
from kvserve.services.cli_support import CliError
from kvserve.services.gateway.router import DEFAULT_STORE_COST

POLICY_ARMS = ("random", "round-robin", "least-load", "session", "cache-aware")
WORKLOADS = ("multi-tenant", "multi-round", "agentic", "mooncake")
# Each workload's shape flags (bench serve's names) with the fleet's defaults.
SHAPES: dict[str, dict[str, Any]] = {
    "multi-tenant": {"tenants": 32, "users-per-tenant": 4, "queries-per-user": 4,
                     "context-len": 4096, "question-len": 128, "output-len": 128},
    "multi-round": {"users": 32, "rounds": 6, "system-len": 1024, "user-context-len": 2048,
                    "question-len": 128, "output-len": 128},
    "agentic": {"agents": 32, "turns": 12, "system-len": 2048, "task-len": 512,
                "tool-output-len": 512, "output-len": 128},
    "mooncake": {"trace": "/work/shared/data/mooncake/conversation_trace.jsonl",
                 "window": "0:400", "scale": 1, "max-context": 8192},
}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    arms = ", ".join(POLICY_ARMS)
    p.add_argument("--workload", choices=WORKLOADS, default="multi-tenant")
    p.add_argument("--arms", default=",".join(POLICY_ARMS), help=f"{arms}, cache-aware@W:C")
    p.add_argument("--workers", default="2", help="worker counts, comma-separated")
    p.add_argument("--disagg", default=None, metavar="P:D",
                   help="a disaggregated fleet of P prefill and D decode workers "
                        "(instead of --workers)")  # fmt: skip
    p.add_argument("--qps", default="1", help="modelled requests/s, comma-separated")
    p.add_argument("--simulate", metavar="PROFILE", default=None, help=SIMULATE_HELP)
    p.add_argument("--time-scale", type=float, default=1.0, help=TIME_SCALE_HELP)
    p.add_argument("--host-qps", type=float, default=None, help=HOST_QPS_HELP)
    p.add_argument("--validate", action="store_true", help=VALIDATE_HELP)
    p.add_argument("--repeats", type=int, default=3, help="--validate: runs of each kind")
    p.add_argument("--router-only", action="store_true", help=ROUTER_ONLY_HELP)
    p.add_argument("--calibrate-each", action="store_true", help=CALIBRATE_EACH_HELP)
    p.add_argument("--worker-threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--store-format", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="wall seconds per request")
    p.add_argument("--warmup-requests", type=int, default=4,
                   help="short requests before each measured run (a fresh worker's first steps "
                        "are slow: page faults, thread choice)")  # fmt: skip
    p.add_argument("--out", default="bench-fleet", metavar="DIR", help="every run's files")
    p.add_argument("--plot", default=None, metavar="PREFIX", help=PLOT_HELP)
    add_gguf(p)
    seen: set[str] = set()
    for workload, shape in SHAPES.items():
        g = p.add_argument_group(f"{workload} (bench serve's shape flags)")
        for flag, default in shape.items():
            if flag in seen:
                continue
            seen.add(flag)
            defaults = ", ".join(f"{s[flag]} ({w})" for w, s in SHAPES.items() if flag in s)
            g.add_argument(f"--{flag}", type=type(default), default=None, help=defaults)


CALIBRATE_EACH_HELP = (
    "--validate: before each repeat, fit the profile's step costs on the steps real workers run "
    "serving the calibration workloads (bench calibrate --served) then and there"
)
ROUTER_ONLY_HELP = (
    "only the router's own costs, in process: a decision at 2, 16 and 64 workers of 10,000 "
    "blocks each (a prompt's first half held by one worker, or by all), and the KV events it "
    "applies per second"
)
HOST_QPS_HELP = (
    "simulated workers: the time scale of each run is its QPS / this (at least 1), so the "
    "machine bears this many requests a wall second at every QPS (overrides --time-scale)"
)
SIMULATE_HELP = "simulated workers on this cost profile (gpu, cpu or a file)"
TIME_SCALE_HELP = "simulated workers run this many times slower than modelled"
VALIDATE_HELP = "run real and simulated (--simulate) workers alike; print each metric's error"
THREADS_HELP = "torch threads of each real worker (default: cores // workers)"
PLOT_HELP = "write PREFIX_<N>w_ttft_vs_qps.png (and PREFIX_throughput_vs_workers.png)"


def parse_arm(name: str) -> Routing:
    """An arm's routing: a policy, or `cache-aware@W:C`, either with `/pd=T` (the gateway's
    --pd-threshold, for a disaggregated fleet); CliError for anything else."""
    base, _, pd = name.partition("/pd=")
    if pd:
        if not pd.isdigit():
            raise CliError(f"--arms: {name!r}: /pd= takes a token count")
        return dataclasses.replace(parse_arm(base), pd_threshold=int(pd))
    if name in POLICY_ARMS:
        return Routing(name)
    policy, _, weights = name.partition("@")
    w, _, c = weights.partition(":")
    try:
        cost = DEFAULT_STORE_COST if not c else None if c == "auto" else float(c)
        routing = Routing(policy, float(w), cost)
    except ValueError:
        routing = None
    if policy != "cache-aware" or routing is None or routing.overlap_weight < 0:
        raise CliError(f"--arms: {name!r} is not one of {POLICY_ARMS} or cache-aware@W:C")
    if routing.store_cost is not None and not 0 <= routing.store_cost <= 1:
        raise CliError(f"--arms: {name!r}: the store cost C must be auto or in [0, 1]")
    return routing


def disagg_counts(text: str) -> tuple[int, int]:
    """--disagg P:D -> (P, D); CliError unless both are positive integers."""
    p, _, d = text.partition(":")
    if not (p.isdigit() and d.isdigit() and int(p) > 0 and int(d) > 0):
        raise CliError(f"--disagg must be P:D, prefill and decode workers, got {text!r}")
    return int(p), int(d)


def _numbers(text: str, flag: str, kind: type) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CliError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise CliError(f"{flag} must be positive numbers, got {text!r}")
    return values


def validate(args: argparse.Namespace) -> tuple[dict[str, Routing], list[int], list[float]]:
    arms = {name: parse_arm(name) for name in args.arms.split(",") if name}
    workers = _numbers(args.workers, "--workers", int)
    if args.disagg is not None:
        p, d = disagg_counts(args.disagg)
        workers = [p + d]
    qps = _numbers(args.qps, "--qps", float)
    if not arms:
        raise CliError("--arms names no arm")
    if args.validate and args.simulate is None:
        raise CliError("--validate compares real workers with simulated ones: give --simulate")
    if not args.time_scale > 0 or (args.host_qps is not None and not args.host_qps > 0):
        raise CliError("--time-scale and --host-qps must be > 0")
    if args.simulate is not None:
        from kvserve.shared.engine.sim.profile import CostProfile, ProfileError

        try:
            CostProfile.load(args.simulate)
        except ProfileError as e:
            raise CliError(str(e)) from None
    return arms, workers, qps


def shape_flags(args: argparse.Namespace) -> list[str]:
    """bench serve's flags for the workload's shape (the fleet's defaults where not given)."""
    out = ["--workload", args.workload]
    for flag, default in SHAPES[args.workload].items():
        value = getattr(args, flag.replace("-", "_"))
        out += [f"--{flag}", str(default if value is None else value)]
    return out


# ---- one run ------------------------------------------------------------------------------------


def bench_serve(
    args: argparse.Namespace, url: str, qps: float, slowdown: float, run_dir: Path
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`kvserve bench serve` against the gateway: its summary and request rows (RuntimeError
    when it fails)."""
    argv = [*shape_flags(args),
            "--request-rate", str(qps), "--slowdown", str(slowdown), "--send-user",
            "--seed", str(args.seed), "--timeout", str(args.timeout), "--no-plots",
            "--warmup-requests", str(args.warmup_requests),
            "--out", str(run_dir)]  # fmt: skip
    proc = run_bench_serve(url, argv, run_dir / "bench-serve.txt")
    summary: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    requests = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    return summary, requests


def run_once(
    args: argparse.Namespace, routing: Routing, workers: Workers, qps: float, run_dir: Path
) -> dict[str, Any]:
    """One fresh deployment under one QPS: its row, or {"error": why}."""
    from kvserve.shared.config import default_model_path

    run_dir.mkdir(parents=True, exist_ok=True)
    model = Path(args.gguf or default_model_path())
    deployment = Deployment(model, routing, workers, run_dir)
    slowdown = workers.time_scale if workers.simulated else 1.0
    try:
        deployment.start()
    except StartError as e:
        return {"qps": qps, "error": str(e)}
    try:
        before = Counters.read(deployment)
        observer = Observer(deployment.url).start()
        summary, requests = bench_serve(args, deployment.url, qps, slowdown, run_dir)
        depth = observer.stop()
        after = Counters.read(deployment)
        router = deployment.router()
        worker_stats = gateway_stats(deployment.url).get("workers") or {}
        store = report.store_blocks(worker_stats)
        late = report.lateness(worker_stats)
    except RuntimeError as e:
        return {"qps": qps, "error": str(e)}
    finally:
        deployment.stop()
    rates = before.rates(after, len(requests), slowdown)
    modelled_s = max(1e-9, (after.wall_s - before.wall_s) / slowdown)
    per_s: dict[str, Any] = {f"store_{k}_per_s": v / modelled_s for k, v in store.items()}
    extra = {"qps": qps, "workers": workers.count, "time_scale": slowdown, **depth, **rates}
    extra |= per_s | {"sim_late_fraction": late / slowdown if late is not None else None}
    return report.row(summary, requests, router, extra)


def time_scale(args: argparse.Namespace, qps: float) -> float:
    """--time-scale, or with --host-qps R, qps / R (at least 1): the host then bears R requests
    a wall second at every QPS of a sweep, and every run takes about as long."""
    return max(1.0, qps / args.host_qps) if args.host_qps else args.time_scale


def _workers(args: argparse.Namespace, n: int, simulated: bool, qps: float) -> Workers:
    threads = args.worker_threads or max(1, (os.cpu_count() or 1) // n)
    p, d = disagg_counts(args.disagg) if args.disagg else (0, 0)
    kind = {"store_format": args.store_format, "prefill": p, "decode": d}
    if simulated:
        return Workers(n, args.simulate, time_scale(args, qps), **kind)
    return Workers(n, threads=threads, **kind)


def sweep(
    args: argparse.Namespace,
    arms: dict[str, Routing],
    n: int,
    qps: list[float],
    simulated: bool,
    tag: str = "",
) -> dict[str, list[dict[str, Any]]]:
    """Every arm at every QPS on `n` workers: {arm: [row per QPS]}; saved after each run
    (under DIR/{real|sim}-{n}w{tag})."""
    out = Path(args.out)
    topology = f"{args.disagg.replace(':', 'p')}d" if args.disagg else f"{n}w"
    kind = f"{'sim' if simulated else 'real'}-{topology}{tag}"
    rows: dict[str, list[dict[str, Any]]] = {}
    for arm, routing in arms.items():
        for q in qps:
            run_dir = out / kind / arm / f"qps-{q:g}"
            r = run_once(args, routing, _workers(args, n, simulated, q), q, run_dir)
            rows.setdefault(arm, []).append(r)
            note = r["error"].splitlines()[0] if "error" in r else _brief(r)
            print(f"[{kind} {arm} qps {q:g}] {note}", flush=True)
            (out / f"{kind}.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def _brief(r: dict[str, Any]) -> str:
    p90 = r.get("ttft_p90_s")
    return (
        f"{r.get('output_tok_s') or 0:.1f} tok/s, p90 TTFT "
        f"{'-' if p90 is None else f'{p90:.3f} s'}, hit {r.get('hit_rate') or 0:.2f}"
    )


# ---- entry --------------------------------------------------------------------------------------


def _plots(prefix: str, by_workers: dict[int, dict[str, list[dict[str, Any]]]], title: str) -> None:
    for n, rows in by_workers.items():
        path = Path(f"{prefix}_{n}w_ttft_vs_qps.png")
        report.plot_ttft_vs_qps(path, rows, f"{title}, {n} workers")
    if len(by_workers) > 1:
        path = Path(f"{prefix}_throughput_vs_workers.png")
        report.plot_throughput_vs_workers(path, by_workers, title)


def router_only() -> dict[str, Any]:
    """The router's decision time and event rate (router_cost), printed and returned."""
    from kvserve.services.bench.sweeps.router_cost import apply_rate, measure

    decisions = []
    for shared_by in ("one", "all"):
        for n in (2, 16, 64):
            d = measure(workers=n, shared_by=shared_by)
            decisions.append(d)
            print(
                f"router: {n:>2} workers x {d['blocks_per_worker']} blocks, first half held by "
                f"{shared_by:>3}: {d['us_median']:.0f} us per decision (p99 {d['us_p99']:.0f})",
                flush=True,
            )
    rates = [apply_rate(hashes_per_event=h) for h in (1, 16, 512)]
    for r in rates:
        print(
            f"router: applies {r['events_per_s']:,.0f} events/s of {r['hashes_per_event']} "
            f"hashes ({r['hashes_per_s']:,.0f} hashes/s) at {r['workers']} workers",
            flush=True,
        )
    return {"decisions": decisions, "apply": rates}


def run(args: argparse.Namespace) -> int:
    if args.router_only:
        print(json.dumps({"router": router_only()}), flush=True)
        return 0
    arms, workers, qps = validate(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    head = {"workload": args.workload, "shape": shape_flags(args)[2:], "profile": args.simulate,
            "time_scale": args.time_scale, "host_qps": args.host_qps}  # fmt: skip
    if args.validate:
        from kvserve.services.bench.sweeps.fleet_validate import validate_runs

        results = validate_runs(args, arms, workers, qps[0], sweep)
        print(report.validation_table(results), flush=True)
        print(json.dumps({**head, "validate": results}), flush=True)
        return 0 if all(r["errors"]["within_targets"] for r in results.values()) else 1
    simulated = args.simulate is not None
    by_workers = {n: sweep(args, arms, n, qps, simulated) for n in workers}
    title = f"{args.workload}, {'simulated: ' + args.simulate if simulated else 'real workers'}"
    for n, rows in by_workers.items():
        print(report.table(f"{title}, {n} workers", rows), flush=True)
    if args.plot:
        _plots(args.plot, by_workers, title)
    result = {**head, "workers": {str(n): rows for n, rows in by_workers.items()}}
    if len(workers) == 1:
        result |= by_workers[workers[0]]
    print(json.dumps(result), flush=True)
    ran = any("error" not in r for rows in by_workers.values() for rs in rows.values() for r in rs)
    return 0 if ran else 1
