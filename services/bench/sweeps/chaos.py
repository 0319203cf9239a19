"""`kvserve bench chaos`: what kvserve survives. A steady load against a real server while
faults are injected one at a time, and per fault what became of every request.

Targets (`--targets`): `serve` (`kvserve serve --store redis://...`), `fleet` (`kvserve
gateway` + 2 `kvserve worker`s on the Redis bus and shared store) and `disagg` (`kvserve
gateway` + 2 `kvserve prefill` + 2 `kvserve decode`), the last two started here one process
each so that one can be killed. Redis is laid out as in compose.yaml: a bus (`noeviction`, 1 GB)
and a store (`allkeys-lru`, 2 GB), each a redis-server of the tool's own behind a FaultProxy of
its own (lib/tcp_proxy.py): every byte between kvserve and Redis crosses one (`serve` has the
store alone: its bus is in the process). Stores use the native format, so that a greedy answer
is the same whichever tier served its prefix. Every process runs with
`--enable-fault-injection`, the front with `--stream-stall-timeout 5`, the workers with
`--claim-idle 3`. The bench supervises the target's processes as compose does: one that dies
is started again 1 s later and counted as a worker lost (not one a fault ends on purpose).

Load: `--rate` requests/s, cycling through streaming and non-streaming, greedy and sampled
(temperature 1.0) /v1/completions of a shared system prompt + one of QUESTIONS, `--max-tokens`
each. Before any fault, every question's greedy answer is taken once (the fault-free reference).

Faults (`--faults`), each: `--calm-s` of load, the fault for `--fault-s`, `--recover-s` of load,
then the load pauses until the server is idle, and blocks and RSS are read:
- redis-kill: SIGKILL, restarted empty after the fault window; redis-pause: SIGSTOP / SIGCONT;
  redis-oom: maxmemory at what is used now with `noeviction`, restored after (each on every
  Redis of the target at once);
- redis-full: the store's maxmemory at what it uses now (still `allkeys-lru`: it evicts to stay
  there), restored after;
- net-delay (50 ms each way per chunk), net-cut (every connection closed at once),
  net-blackhole (nothing forwarded; stalled connections closed at the end), on every proxy;
- worker-kill (fleet), prefill-kill, decode-kill (disagg): SIGKILL worker-1 / prefill-1 /
  decode-1, restarted after the window; gateway-term (SIGTERM the gateway or the serve
  process: it drains and exits; restarted after the window);
- client-disconnect (8 streams dropped after their first chunk), burst (4 x --max-queue requests
  at once);
- poison-raise: 4 poisoned requests (one of each kind, `"kvserve_fault": "raise"`: it raises in
  its own processing) spread over the window; poison-kill (fleet, disagg): one poisoned request
  that SIGKILLs each worker that runs it, until a worker taking it over quarantines it;
- worker-stop: SIGSTOP worker-1 (fleet), decode-1 (disagg) or the serve process, once 4 greedy
  streams are under way, for the window (longer than the workers' --claim-idle), then SIGCONT;
- slow-reader: 4 streams opened on sockets that are never read (big events: 20 logprobs a token),
  held until the front has aborted each as stalled;
- bad-message (fleet, disagg): garbage written straight into every bus stream its readers read
  and into the workers' info and stats hashes (sweeps/chaos_garbage.py).
A fault that does not apply to a target is reported skipped, with why.

`--soak-min N` first runs the load without faults for N minutes; after each minute the load
pauses until the server is idle and it reads the KV blocks in use, the servers' RSS, their open
file descriptors, Redis's connected clients and memory used (each server), every bus stream's
length and its consumer groups' pending entries, and the error lines logged; it reports them per
minute and their least-squares slopes (`--faults none`: the soak alone).

A request's outcome: `ok` (finished; greedy ones compared with the reference: `wrong` if the
text differs), `http_NNN` (an error status; Retry-After noted), `stream_error` (an error event),
`refused` (no server listening), `disconnected` (the client dropped it on purpose), `lost` (no
terminal answer within --timeout, or a stream cut without one); a failure's error code is
kept. Per fault, for requests sent from its start to the end of its recovery: sent, ok, wrong,
lost, failed by kind, the poisoned requests apart (how each ended, with its code), the processes
that died, p99 TTFT against the calm period's (its requests that ended before the fault),
seconds until the store took writes again after Redis came back, KV blocks in use when idle
after the fault against before the run (0 leaked), RSS growth, and the fault's counters
(sweeps/chaos_counters.py: streams aborted as stalled, bus messages dropped, keys evicted per
Redis, requests the stopped worker found taken over).
Prints a table per target; the last line printed is one JSON object; `--out DIR` keeps the
servers' logs, requests.jsonl and chaos.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvserve.services.bench.sweeps.chaos_faults import FAULTS, run_fault, skip_reason
from kvserve.services.bench.sweeps.chaos_load import Load
from kvserve.services.bench.sweeps.chaos_redis import RedisNode
from kvserve.services.bench.sweeps.chaos_report import FaultReport, soak_table, table
from kvserve.services.bench.sweeps.chaos_rig import Rig
from kvserve.services.bench.sweeps.chaos_soak import run_soak
from kvserve.services.bench.sweeps.chaos_supervisor import Supervisor
from kvserve.services.bench.sweeps.chaos_target import CLAIM_IDLE_S, TARGETS, Target, idle
from kvserve.services.cli_support import CliError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {TARGETS}")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma list of {FAULTS}, or none")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--calm-s", type=float, default=15.0)
    p.add_argument("--fault-s", type=float, default=10.0)
    p.add_argument("--recover-s", type=float, default=15.0)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--max-queue", type=int, default=8, help="the gateway's bound (burst fault)")
    p.add_argument("--num-blocks", type=int, default=512, help="each engine's KV-cache blocks")
    p.add_argument("--host-tier-mb", type=int, default=512, help="each engine's host tier")
    p.add_argument("--timeout", type=float, default=120.0, help="a request's, seconds")
    p.add_argument("--model", default=None, help="GGUF (default: the default model)")
    p.add_argument("--out", type=Path, default=Path("bench-chaos"))
    p.add_argument("--soak-min", type=int, default=0,
                   help="first a soak: this many minutes of load without faults")  # fmt: skip


def _check(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    targets = [t for t in args.targets.split(",") if t]
    faults = [f for f in args.faults.split(",") if f and f != "none"]
    if not targets or set(targets) - set(TARGETS):
        raise CliError(f"--targets must be a comma list of {', '.join(TARGETS)}")
    if (not faults and args.faults != "none") or set(faults) - set(FAULTS):
        raise CliError(f"--faults must be a comma list of {', '.join(FAULTS)}")
    if min(args.rate, args.fault_s, args.recover_s, args.timeout) <= 0 or args.calm_s < 0:
        raise CliError("--rate, --fault-s, --recover-s and --timeout must be > 0, --calm-s >= 0")
    if args.soak_min < 0:
        raise CliError("--soak-min must be >= 0")
    if args.num_blocks < 1 or args.host_tier_mb < 0:
        raise CliError("--num-blocks must be >= 1 and --host-tier-mb >= 0")
    if args.max_tokens < 1 or args.max_queue < 1:
        raise CliError("--max-tokens and --max-queue must be >= 1")
    if "worker-stop" in faults and args.fault_s <= CLAIM_IDLE_S:
        raise CliError(
            f"worker-stop: --fault-s must exceed the workers' --claim-idle ({CLAIM_IDLE_S:g} s)"
        )
    return targets, faults


async def _faults(rig: Rig, faults: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The soak (with --soak-min), then each fault of this topology in turn, under load."""
    kind, load = rig.target.kind, rig.load
    base = await idle(rig.target)
    reports: list[FaultReport] = []
    result: dict[str, Any] = {"target": kind, "faults": reports}
    sender = asyncio.create_task(load.run())
    supervisor = asyncio.create_task(rig.supervisor.run())
    try:
        if args.soak_min:
            result["soak"] = await run_soak(rig, args)
        for fault in faults:
            if (why := skip_reason(fault, rig.target)) is not None:
                reports.append(FaultReport(fault, skipped=why))
                continue
            print(f"[{kind}] {fault} ...", flush=True)
            reports.append(await run_fault(rig, fault, args, base))
            print(f"[{kind}] {fault}: {asdict(reports[-1])}", flush=True)
    finally:
        sender.cancel()
        supervisor.cancel()
        await asyncio.gather(sender, supervisor, return_exceptions=True)
    return result


async def _load_target(
    redis: list[RedisNode], target: Target, faults: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """The reference answers, then the faults; every request a line of out/requests.jsonl."""
    import aiohttp

    out = args.out / target.kind
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        load = Load(target.base_url, target.kind, args, http)
        await load.references()
        rig = Rig(redis, target, load, Supervisor(target.procs))
        result = await _faults(rig, faults, args)
        with (out / "requests.jsonl").open("w") as f:
            for o in load.outcomes:
                f.write(json.dumps(asdict(o)) + "\n")
    return result


async def run_target(kind: str, faults: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One topology on Redis servers of its own behind fault proxies, started, loaded,
    stopped."""
    out = args.out / kind
    out.mkdir(parents=True, exist_ok=True)
    roles = ("store",) if kind == "serve" else ("bus", "store")
    redis = [RedisNode(role, out / f"redis-{role}.log") for role in roles]
    try:
        for node in redis:
            node.start()
        bus = redis[0].url if kind != "serve" else None
        target = Target(kind, (bus, redis[-1].url), args, out)
        try:
            await asyncio.to_thread(target.start)
            result = await _load_target(redis, target, faults, args)
        finally:
            await asyncio.to_thread(target.stop)
    finally:
        for node in redis:
            node.stop()
    result["faults"] = [asdict(r) for r in result["faults"]]
    return result


def run(args: argparse.Namespace) -> int:
    targets, faults = _check(args)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for kind in targets:
        result = asyncio.run(run_target(kind, faults, args))
        print(soak_table(result) + "\n" + table(result), flush=True)
        results.append(result)
    (args.out / "chaos.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results))
    return 0
