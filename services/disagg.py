"""The disaggregated workers: `kvserve prefill` and `kvserve decode` (DESIGN.md section 2).

A prefill worker reads generate requests from the `kvserve:prefill` consumer group, runs the
prompt minus its last token (max_tokens=1, `export_tail`), puts the partial last block under the
request's tail key, flushes the store writes (so every full block is stored), then forwards the
same request (traceparent now its own span) to the `kvserve:decode` stream. It never sends a
token to the client; it acks a request only once forwarded (or failed/cancelled), so a prefill
worker that dies leaves its requests pending for another one (XAUTOCLAIM).

A decode worker reads `kvserve:decode`, fetches the request's tail from the store, and runs the
full request with it (`kv_tail`): the engine loads the full blocks from the store and computes
only the last prompt token; without the tail (a redelivery: the tail is deleted on read) it
recomputes what the store lacks. Token events go out exactly as from the `serve` worker.

Both serve Prometheus /metrics (the engine's stats) on `--metrics-port` (0: off).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

from kvserve.services.cli import CliError, stop_on_signals
from kvserve.services.serve import add_engine_arguments
from kvserve.shared.config import STORE_FORMATS, default_model_path

ROLES = ("prefill", "decode")


def register_worker(sub: argparse._SubParsersAction, role: str) -> None:
    help_ = {
        "prefill": "prefill worker: computes prompts into the prefix store, hands off to decode",
        "decode": "decode worker: loads prefilled blocks from the store and streams tokens",
    }[role]
    p = sub.add_parser(role, help=help_)
    p.add_argument("--bus", required=True, help="redis://HOST:PORT/DB of the request bus")
    p.add_argument("--store", required=True, help="prefix store URL (redis://HOST:PORT/DB)")
    p.add_argument("--store-format", choices=STORE_FORMATS, default="native")
    p.add_argument("--metrics-port", type=int, default=9100, help="Prometheus /metrics; 0: off")
    p.add_argument("--metrics-host", default="0.0.0.0")
    p.add_argument("--name", default=None, help="worker name on the bus (default: role-host-pid)")
    p.add_argument(
        "--claim-idle",
        type=float,
        default=30.0,
        help="seconds after which a dead worker's pending request is claimed",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds, on SIGTERM")
    p.add_argument("--model", default=str(default_model_path()), help="GGUF file or HF dir")
    add_engine_arguments(p)
    p.set_defaults(handler=lambda args: run(args, role))


def _check(args: argparse.Namespace) -> None:
    for url, flag in ((args.bus, "--bus"), (args.store, "--store")):
        if not url.startswith(("redis://", "rediss://", "unix://")) and flag == "--bus":
            raise CliError(f"{flag} must be a redis:// URL, got {url!r}")
    if args.store == "none":
        raise CliError("--store is required: prefill and decode meet only in the store")
    if not 0 <= args.metrics_port <= 65535:
        raise CliError(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    if args.claim_idle <= 0 or args.drain_timeout <= 0:
        raise CliError("--claim-idle and --drain-timeout must be > 0")
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be >= 1")


def run(args: argparse.Namespace, role: str) -> int:
    from kvserve.shared.telemetry import configure_logging, configure_tracing, shutdown_tracing

    _check(args)
    configure_logging(args.log_level)
    configure_tracing(f"kvserve-{role}")
    try:
        asyncio.run(_work(args, role))
    finally:
        shutdown_tracing()
    return 0


def _load_engine(args: argparse.Namespace) -> Any:
    from kvserve.services.serve import engine_config
    from kvserve.shared.engine.async_engine import AsyncEngine
    from kvserve.shared.engine.engine import Engine

    return AsyncEngine(Engine(engine_config(args)))


def _start_metrics(args: argparse.Namespace, name: str, stats: Callable[[], Any]) -> str:
    """Serve the worker's engine stats as Prometheus metrics; the URL ('' when off)."""
    if not args.metrics_port:
        return ""
    from kvserve.shared.telemetry import EngineStatsCollector
    from prometheus_client import CollectorRegistry, start_http_server

    class WorkerCollector(EngineStatsCollector):
        def collect(self) -> Iterator[Any]:
            self.snapshot = {name: stats()}
            yield from super().collect()

    registry = CollectorRegistry()
    registry.register(WorkerCollector(os.path.basename(args.model)))
    try:
        start_http_server(args.metrics_port, args.metrics_host, registry=registry)
    except OSError as e:
        raise CliError(f"cannot serve metrics on port {args.metrics_port}: {e}") from e
    host = "127.0.0.1" if args.metrics_host in ("0.0.0.0", "::") else args.metrics_host
    return f"http://{host}:{args.metrics_port}/metrics"


async def _work(args: argparse.Namespace, role: str) -> None:
    from kvserve.services.disagg_workers import DecodeWorker, PrefillWorker
    from kvserve.shared.bus import RedisBus, RedisBusConfig
    from kvserve.shared.telemetry import get_logger

    log = get_logger(f"kvserve.{role}")
    name = args.name or f"{role}-{socket.gethostname()}-{os.getpid()}"
    stop = stop_on_signals()
    engine = await asyncio.to_thread(_load_engine, args)
    if engine.engine.connector is None:
        raise CliError("--store: the engine has no prefix store")
    cfg = RedisBusConfig(request_stream=role, group=role, claim_idle_s=args.claim_idle)
    bus = RedisBus(args.bus, cfg)
    worker: Any
    model = os.path.basename(args.model).split(".")[0]
    if role == "prefill":
        out = RedisBus(
            args.bus, dataclasses.replace(cfg, request_stream="decode", group="decode"), bus.redis
        )
        worker = PrefillWorker(bus.worker(name), engine, out.submit)
    else:
        worker = DecodeWorker(bus.worker(name), engine)
    worker.model_name = model
    metrics_url = _start_metrics(args, name, worker.stats)
    await worker.start()
    log.info("ready", role=role, worker=name, url=metrics_url or f"bus:{name}")
    await stop.wait()
    log.info("shutting down", drain_timeout_s=args.drain_timeout)
    await worker.stop(drain_timeout=args.drain_timeout)
    engine.stop()
    await asyncio.to_thread(engine.engine.close)
    await bus.close()
    log.info("stopped")
