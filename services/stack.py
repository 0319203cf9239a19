"""`kvserve stack`: the disaggregated topology on this machine, for development: a gateway,
`--prefill` prefill workers and `--decode` decode workers as subprocesses, on one Redis (bus
and prefix store). The workers share the machine's cores: each gets `--threads-per-worker`
torch threads (default: the cores divided among them, at least one), so that they do not
oversubscribe the cores. Ctrl-C / SIGTERM stops them all (SIGTERM, then SIGKILL after a
grace)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from kvserve.services.cli_support import CliError
from kvserve.shared.config import default_model_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stack", help="run gateway + prefill + decode workers locally on Redis")
    p.add_argument("--redis", required=True, help="redis://HOST:PORT/DB: bus and prefix store")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", type=int, default=2, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--metrics-port", type=int, default=9100, help="first worker's; 0: off")
    p.add_argument("--grace", type=float, default=40.0, help="seconds before SIGKILL on stop")
    p.add_argument("--request-timeout", type=float, default=600.0, help="the gateway's, seconds")
    p.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        help="torch threads of each worker (default: cores // workers, at least 1)",
    )
    p.set_defaults(handler=run)


def worker_threads(args: argparse.Namespace) -> int:
    if args.threads_per_worker is not None:
        return args.threads_per_worker
    return max(1, (os.cpu_count() or 1) // (args.prefill + args.decode))


def commands(args: argparse.Namespace) -> list[list[str]]:
    base = [sys.executable, "-m", "kvserve.services.cli"]
    threads = str(worker_threads(args))
    out = [
        [*base, "gateway", "--bus", args.redis, "--host", args.host, "--port", str(args.port),
         "--model", args.model, "--request-timeout", str(args.request_timeout)],
    ]  # fmt: skip
    i = 0
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for _ in range(count):
            metrics = str(args.metrics_port + i) if args.metrics_port else "0"
            out.append(
                [*base, role, "--bus", args.redis, "--store", args.redis, "--model", args.model,
                 "--metrics-port", metrics, "--threads", threads]
            )  # fmt: skip
            i += 1
    return out


def run(args: argparse.Namespace) -> int:
    _check(args)
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    procs = [subprocess.Popen(cmd) for cmd in commands(args)]
    print(
        f"kvserve stack: gateway on http://{args.host}:{args.port}/v1, {args.prefill} prefill, "
        f"{args.decode} decode worker(s) on {args.redis}; Ctrl-C stops",
        flush=True,
    )
    status = 0
    try:
        while not stopping:
            if any(p.poll() is not None for p in procs):
                print("kvserve stack: a process exited; stopping the others", file=sys.stderr)
                status = 1
                break
            time.sleep(0.5)  # polling the children and the stop flag the signals set
    finally:
        _stop_all(procs, args.grace)
    return status


def _check(args: argparse.Namespace) -> None:
    if args.prefill < 1 or args.decode < 1:
        raise CliError("--prefill and --decode must be >= 1")
    if not args.redis.startswith(("redis://", "rediss://")):
        raise CliError(f"--redis must be a redis:// URL, got {args.redis!r}")
    if args.request_timeout <= 0:
        raise CliError("--request-timeout must be > 0")
    if args.grace < 0:
        raise CliError("--grace must be >= 0")
    if args.threads_per_worker is not None and args.threads_per_worker < 1:
        raise CliError("--threads-per-worker must be >= 1")


def _stop_all(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM to every process still running, SIGKILL to those still running `grace`
    seconds later."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
