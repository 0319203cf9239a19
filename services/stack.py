"""`kvserve stack`: a kvserve topology on this machine, for development, as subprocesses on
Redis: the bus on `--redis` and the prefix store (unless `--worker-store local`) on
`--store-redis`, the same server by default (compose.yaml runs two, a bus that Redis never evicts
and a store that it does; `--store-redis` lays the stack out the same way):

- aggregated (`--workers N`, N >= 1): a gateway and N `kvserve worker` processes (prefill and
  decode in one engine, named `worker-0` ... `worker-{N-1}`); the gateway routes each request
  to one of them (`--routing`). `--worker-store shared` gives every worker the Redis store, so
  a block one computes serves all; `local` gives each its own `memory://` store.
- disaggregated (`--workers 0`, the default): a gateway, `--prefill` prefill workers (2) and
  `--decode` decode workers (1), which meet only in the Redis store; the gateway routes among
  the prefill workers.

Every worker gets `--store-format`, the speculative decoding options given (`--speculative`
and its own) and the next metrics port from `--metrics-port` on. The workers share the
machine's cores: each gets `--threads-per-worker` torch threads (default: the cores divided
among them, at least one), so that they do not oversubscribe the cores. With
`--simulate PROFILE` the workers are simulated (DESIGN.md section 2.2), all of them in one
`kvserve sim-fleet` process, named as the real ones would be.

The stack supervises its processes as compose's `restart: unless-stopped` does
(services/supervisor.py): a worker (or the sim-fleet process) that exits is started again with
the same command line, so under the same name and metrics port, after a back-off of 1 s
doubling to 30 s (reset once it has run for a minute), with one line on stderr per restart; the
requests it held are taken over by the fleet (another worker, or the restarted one, claims them
and continues each token-exactly). Ctrl-C / SIGTERM stops them all (SIGTERM, then SIGKILL after
`--grace`), exit status 0; so does the gateway exiting, exit status 1."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from kvserve.services.cli_support import CliError
from kvserve.services.engine_options import (
    add_async_scheduling_argument,
    add_speculative_arguments,
    check_sim_arguments,
    speculative_config,
    speculative_flags,
)
from kvserve.services.gateway.router import POLICIES
from kvserve.services.supervisor import Supervisor
from kvserve.shared.config import (
    KV_DTYPES,
    POPULATE_MODES,
    SIM_PAYLOADS,
    STORE_FORMATS,
    default_model_path,
)

CLAIM_IDLE_S = 30.0  # the workers' --claim-idle default
QUARANTINE_AFTER = 2  # the workers' --quarantine-after default
DEFAULT_PREFILL = 2
DEFAULT_DECODE = 1
REDIS_STORE_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")
WorkerRole = tuple[str, str]  # (subcommand, --name)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stack", help="run a gateway and its workers locally on Redis")
    p.add_argument(
        "--redis", required=True, help="redis://HOST:PORT/DB: the bus (and the prefix store)"
    )
    p.add_argument(
        "--store-redis",
        default=None,
        metavar="URL",
        help="the prefix store's Redis (redis://, redis+cluster://); default: --redis",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="aggregated engine workers; 0: the disaggregated topology (--prefill, --decode)",
    )
    p.add_argument("--prefill", type=int, default=None, help=f"prefill workers ({DEFAULT_PREFILL})")
    p.add_argument("--decode", type=int, default=None, help=f"decode workers ({DEFAULT_DECODE})")
    p.add_argument("--routing", choices=POLICIES, default="cache-aware", help="the gateway's")
    p.add_argument("--pd-threshold", type=int, default=0,
                   help="the gateway's: shorter uncached parts go to decode")  # fmt: skip
    p.add_argument(
        "--worker-store",
        choices=("shared", "local"),
        default="shared",
        help="shared: every worker on the Redis store; local: each its own memory:// store",
    )
    p.add_argument("--store-format", choices=STORE_FORMATS, default="auto")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto", help="the workers' KV cache")
    p.add_argument(
        "--kv-populate",
        choices=POPULATE_MODES,
        default="background",
        help="the workers': when their KV cache's memory becomes resident",
    )
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
    p.add_argument(
        "--claim-idle",
        type=float,
        default=CLAIM_IDLE_S,
        help="the workers': seconds before a dead worker's request is taken over",
    )
    p.add_argument(
        "--quarantine-after",
        type=int,
        default=QUARANTINE_AFTER,
        metavar="K",
        help="the workers': fail a request that killed K workers",
    )
    p.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="gateway and workers accept `kvserve_fault` (tests, chaos runs)",
    )
    add_speculative_arguments(p)  # the workers'
    add_async_scheduling_argument(p)  # the workers'
    g = p.add_argument_group("simulation")
    g.add_argument("--simulate", metavar="PROFILE", default=None,
                   help="simulated workers (one sim-fleet process) on this cost profile: gpu, "
                        "cpu or a file")  # fmt: skip
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="simulated workers run this many times slower than modelled")  # fmt: skip
    g.add_argument("--sim-payload", choices=SIM_PAYLOADS, default="auto")
    p.set_defaults(handler=run)


def worker_roles(args: argparse.Namespace) -> list[WorkerRole]:
    """Each worker process's subcommand and --name, in start order; a name is kept across
    restarts. Named as sim-fleet names simulated workers: `worker-{i}`, `worker-prefill-{i}`,
    `worker-decode-{i}`."""
    if args.workers >= 1:
        return [("worker", f"worker-{i}") for i in range(args.workers)]
    prefill = DEFAULT_PREFILL if args.prefill is None else args.prefill
    decode = DEFAULT_DECODE if args.decode is None else args.decode
    counts = (("prefill", prefill), ("decode", decode))
    return [(role, f"worker-{role}-{i}") for role, n in counts for i in range(n)]


def process_names(args: argparse.Namespace) -> list[str]:
    """The name of each of `commands`' processes, in its order (the supervisor's log lines)."""
    workers = ["sim-fleet"] if args.simulate is not None else [n for _, n in worker_roles(args)]
    return ["gateway", *workers]


def worker_threads(args: argparse.Namespace) -> int:
    if args.threads_per_worker is not None:
        return args.threads_per_worker
    return max(1, (os.cpu_count() or 1) // max(1, len(worker_roles(args))))


def shared_store(args: argparse.Namespace) -> str:
    """The Redis URL of the shared prefix store: `--store-redis`, else the bus's."""
    return args.store_redis or args.redis


def worker_store(args: argparse.Namespace) -> str:
    return shared_store(args) if args.worker_store == "shared" else "memory://"


def commands(args: argparse.Namespace) -> list[list[str]]:
    """The gateway's command line, then each worker's (worker_roles' order)."""
    # -P: the working directory stays off sys.path (a checkout's top-level kernels/ folder
    # would shadow the installed package of that name).
    base = [sys.executable, "-P", "-m", "kvserve.services.cli"]
    threads = str(worker_threads(args))
    out = [
        [*base, "gateway", "--bus", args.redis, "--host", args.host, "--port", str(args.port),
         "--model", args.model, "--request-timeout", str(args.request_timeout),
         "--routing", args.routing],
    ]  # fmt: skip
    if args.pd_threshold:
        out[0] += ["--pd-threshold", str(args.pd_threshold)]
    faults = ["--enable-fault-injection"] if args.enable_fault_injection else []
    out[0] += faults
    # the workers' own defaults unless asked otherwise
    own = [] if args.claim_idle == CLAIM_IDLE_S else ["--claim-idle", str(args.claim_idle)]
    if args.quarantine_after != QUARANTINE_AFTER:
        own += ["--quarantine-after", str(args.quarantine_after)]
    if args.kv_dtype != "auto":
        own += ["--kv-dtype", args.kv_dtype]
    if args.kv_populate != "background":
        own += ["--kv-populate", args.kv_populate]
    own += speculative_flags(args)
    if not args.async_scheduling:
        own += ["--no-async-scheduling"]
    if args.simulate is not None:
        return [*out, sim_fleet_command(args, base)]
    for i, (role, name) in enumerate(worker_roles(args)):
        metrics = str(args.metrics_port + i) if args.metrics_port else "0"
        command = [*base, role, "--bus", args.redis, "--store", worker_store(args),
                   "--store-format", args.store_format, "--model", args.model,
                   "--metrics-port", metrics, "--threads", threads, *own,
                   *faults]  # fmt: skip
        out.append([*command, "--name", name])
    return out


def sim_fleet_command(args: argparse.Namespace, base: list[str]) -> list[str]:
    """The one process of every simulated worker, named as the real workers would be
    (aggregated workers `worker-{i}`; prefill and decode `worker-prefill-{i}`, ...)."""
    roles = [role for role, _ in worker_roles(args)]
    counts = (
        ["--workers", str(len(roles))]
        if args.workers >= 1
        else ["--prefill", str(roles.count("prefill")), "--decode", str(roles.count("decode"))]
    )
    return [*base, "sim-fleet", "--bus", args.redis, "--store", worker_store(args),
            "--store-format", args.store_format, "--model", args.model, "--profile",
            args.simulate, "--time-scale", str(args.time_scale), "--sim-payload",
            args.sim_payload, "--name-prefix", "worker", *counts]  # fmt: skip


def banner(args: argparse.Namespace) -> str:
    """The line `run` prints once the processes are started: topology, gateway URL, workers."""
    roles = [role for role, _ in worker_roles(args)]
    if args.workers >= 1:
        topology = "aggregated"
        workers = f"{len(roles)} worker(s) on a {args.worker_store} store"
    else:
        topology = "disaggregated"
        workers = f"{roles.count('prefill')} prefill, {roles.count('decode')} decode worker(s)"
    sim = f" simulated on profile {args.simulate}" if args.simulate is not None else ""
    store = f", store {args.store_redis}" if args.store_redis is not None else ""
    return (
        f"kvserve stack ({topology}): gateway on http://{args.host}:{args.port}/v1 "
        f"({args.routing} routing), {workers}{sim}, bus {args.redis}{store}; Ctrl-C stops"
    )


def run(args: argparse.Namespace) -> int:
    """Start the processes and keep the workers running until Ctrl-C / SIGTERM (0) or the
    gateway's exit (1); then stop them all."""
    _check(args)
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    names, cmds = process_names(args), commands(args)
    workers = list(zip(names[1:], cmds[1:], strict=True))
    supervisor = Supervisor((names[0], cmds[0]), workers, log=_log)
    print(banner(args), flush=True)
    try:
        while not stopping:
            if supervisor.step() is not None:
                return 0 if stopping else 1  # the gateway exits on Ctrl-C too
            time.sleep(0.5)  # polling the children and the stop flag the signals set
        return 0
    finally:
        supervisor.stop(args.grace)


def _log(line: str) -> None:
    print(f"kvserve stack: {line}", file=sys.stderr, flush=True)


def _check(args: argparse.Namespace) -> None:
    _check_topology(args)
    if not args.redis.startswith(("redis://", "rediss://")):
        raise CliError(f"--redis must be a redis:// URL, got {args.redis!r}")
    if args.store_redis is not None:
        if not args.store_redis.startswith(REDIS_STORE_SCHEMES):
            raise CliError(f"--store-redis must be a redis:// URL, got {args.store_redis!r}")
        if args.worker_store == "local":
            raise CliError("--store-redis is the shared store; --worker-store local has none")
    if args.request_timeout <= 0 or args.claim_idle <= 0:
        raise CliError("--request-timeout and --claim-idle must be > 0")
    if args.quarantine_after < 1:
        raise CliError("--quarantine-after must be >= 1")
    if args.grace < 0:
        raise CliError("--grace must be >= 0")
    if args.threads_per_worker is not None and args.threads_per_worker < 1:
        raise CliError("--threads-per-worker must be >= 1")
    check_sim_arguments(args)
    speculative_config(args)


def _check_topology(args: argparse.Namespace) -> None:
    """--workers picks the aggregated topology; --prefill/--decode belong to the other one."""
    if args.workers < 0:
        raise CliError("--workers must be >= 0")
    if args.workers >= 1:
        if args.prefill is not None or args.decode is not None:
            raise CliError("--prefill/--decode are for the disaggregated topology, not --workers")
        return
    if any(n is not None and n < 1 for n in (args.prefill, args.decode)):
        raise CliError("--prefill and --decode must be >= 1")
    if args.worker_store == "local":
        raise CliError("--worker-store local needs --workers: prefill and decode meet in the store")
