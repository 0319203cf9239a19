"""`kvserve worker`, `kvserve prefill` and `kvserve decode`: the engine workers on the Redis bus
(DESIGN.md section 2; the workers themselves are services/workers/).

- `worker`: prefill and decode in one engine (as inside `kvserve serve`); N of them behind
  `kvserve gateway`, which routes each request to one of them (its own stream `kvserve:to:NAME`).
- `prefill` / `decode`: the disaggregated topology; they meet only in the prefix store.

Every worker reads its own stream and its role's shared stream (`kvserve:prefill` for workers
and prefill workers, `kvserve:decode`) through a consumer group: a request that a dead worker
held is claimed by another after `--claim-idle` seconds, and a dead worker's own stream is
adopted. Workers and prefill workers publish their KV events for the gateway's router. `--store`
is required (a redis:// URL shares blocks between workers; `memory://` keeps them to the
worker). Each serves Prometheus /metrics (the engine's stats) on `--metrics-port` (0: off),
bound to `--metrics-host` (127.0.0.1 unless told otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
from typing import Any

from kvserve.services.cli_support import (
    CliError,
    check_bus_url,
    check_port,
    check_positive,
    run_service,
    stop_on_signals,
)
from kvserve.services.engine_options import (
    add_engine_arguments,
    add_sim_arguments,
    check_engine_arguments,
    engine_config,
    load_engine,
)
from kvserve.shared.config import STORE_FORMATS, default_model_path

HELP = {
    "worker": "engine worker (prefill and decode in one engine) behind `kvserve gateway`",
    "prefill": "prefill worker: computes prompts into the prefix store, hands off to decode",
    "decode": "decode worker: loads prefilled blocks from the store and streams tokens",
}


def register_worker(sub: argparse._SubParsersAction) -> None:
    _register(sub, "worker")


def register_prefill(sub: argparse._SubParsersAction) -> None:
    _register(sub, "prefill")


def register_decode(sub: argparse._SubParsersAction) -> None:
    _register(sub, "decode")


def _register(sub: argparse._SubParsersAction, role: str) -> None:
    p = sub.add_parser(role, help=HELP[role])
    p.add_argument("--bus", required=True, help="redis://HOST:PORT/DB of the request bus")
    p.add_argument("--store", required=True, help="prefix store URL (redis://HOST:PORT/DB)")
    p.add_argument("--store-format", choices=STORE_FORMATS, default="auto")
    p.add_argument("--metrics-port", type=int, default=9100, help="Prometheus /metrics; 0: off")
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint binds (0.0.0.0: every interface, as in a container)",
    )
    p.add_argument("--name", default=None, help="worker name on the bus (default: role-host-pid)")
    p.add_argument(
        "--claim-idle",
        type=float,
        default=30.0,
        help="seconds after which a dead worker's pending request is claimed",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds, on SIGTERM")
    p.add_argument("--model", default=str(default_model_path()), help="GGUF file or HF dir")
    p.add_argument(
        "--step-log",
        metavar="FILE",
        default=None,
        help="append every engine step's batch shape and seconds to FILE (JSON lines; "
        "`kvserve bench calibrate --served` fits a cost profile on them)",
    )
    add_engine_arguments(p)
    add_sim_arguments(p)
    p.set_defaults(handler=lambda args: run(args, role))


def _check(args: argparse.Namespace) -> None:
    check_bus_url(args.bus)
    if args.store == "none":
        raise CliError("--store must name a store (redis://... to share blocks, or memory://)")
    check_port("--metrics-port", args.metrics_port)
    check_positive(args, ("claim_idle", "drain_timeout"))
    check_engine_arguments(args)


def run(args: argparse.Namespace, role: str) -> int:
    _check(args)

    async def work(args: argparse.Namespace) -> None:
        await _work(args, role)

    return run_service(args, role, work)


def _start_metrics(args: argparse.Namespace, name: str, worker: Any) -> str:
    """Serve the worker's engine stats as Prometheus metrics; the URL ('' when off)."""
    if not args.metrics_port:
        return ""
    from kvserve.services.workers.metrics import serve_worker_metrics

    model = os.path.basename(args.model)
    try:
        return serve_worker_metrics(args.metrics_host, args.metrics_port, model, name, worker.stats)
    except OSError as e:
        raise CliError(f"cannot serve metrics on port {args.metrics_port}: {e}") from e


def make_worker(
    args: argparse.Namespace, role: str, name: str, engine: Any, redis: Any = None
) -> tuple[Any, Any]:
    """The role's worker on its Redis consumer group, and the bus it reads (to close), on a
    client of its own or `redis` (many workers in one process share one). Aggregated and
    prefill workers share the `prefill` stream (a gateway's unrouted work)."""
    from kvserve.shared.bus.redis import RedisBus
    from kvserve.shared.bus.redis_layout import RedisBusConfig

    stream = "decode" if role == "decode" else "prefill"
    cfg = RedisBusConfig(request_stream=stream, group=stream, claim_idle_s=args.claim_idle)
    # a taken-over request that killed this many workers is failed (workers/probation.py)
    quarantine = {"quarantine_after": getattr(args, "quarantine_after", 2)}
    bus = RedisBus(args.bus, cfg, redis)
    worker: Any
    if role == "worker":
        from kvserve.services.workers.engine_worker import EngineWorker

        worker = EngineWorker(bus.worker(name), engine, kv_events=True, **quarantine)
    elif role == "prefill":
        from kvserve.services.workers.prefill import PrefillWorker

        decode_cfg = dataclasses.replace(cfg, request_stream="decode", group="decode")
        out = RedisBus(args.bus, decode_cfg, bus.redis, drops=bus.drops)
        worker = PrefillWorker(bus.worker(name), engine, out.send, kv_events=True, **quarantine)
    else:
        from kvserve.services.workers.decode import DecodeWorker

        # Its KV events let a gateway send it the requests whose prefill it computes itself
        # (--pd-threshold) by the blocks it holds.
        worker = DecodeWorker(bus.worker(name), engine, kv_events=True, **quarantine)
    worker.model_name = os.path.basename(args.model).split(".")[0]
    return worker, bus


async def _work(args: argparse.Namespace, role: str) -> None:
    from kvserve.shared.telemetry import get_logger

    log = get_logger(f"kvserve.{role}")
    name = args.name or f"{role}-{socket.gethostname()}-{os.getpid()}"
    stop = stop_on_signals()
    engine = await asyncio.to_thread(load_engine, engine_config(args))
    if engine.store_url is None:
        raise CliError("--store: the engine has no prefix store")
    if args.step_log:
        engine.log_steps(args.step_log)
    worker, bus = make_worker(args, role, name, engine)
    metrics_url = _start_metrics(args, name, worker)
    await worker.start()
    if engine.simulation is not None:
        log.info("simulated", worker=name, simulation=engine.simulation)
    log.info("ready", role=role, worker=name, url=metrics_url or f"bus:{name}")
    failed = asyncio.create_task(worker.engine_failed.wait())
    await asyncio.wait([asyncio.create_task(stop.wait()), failed], return_when="FIRST_COMPLETED")
    log.info("shutting down", drain_timeout_s=args.drain_timeout)
    await worker.stop(drain_timeout=args.drain_timeout)
    await asyncio.to_thread(engine.close)
    await bus.close()
    if failed.done():
        raise CliError("the engine failed; exiting for a supervisor to restart the worker")
    log.info("stopped")
