"""`kvserve serve`: gateway, in-process bus, engine worker and engine in one process.

Start-up order: the HTTP server listens first (/health answers, /ready is 503), the engine
loads in a thread, then the worker registers on the bus and /ready turns 200.
Shutdown (SIGTERM or SIGINT): /ready turns 503 and new requests are refused (503), running
ones get `--drain-timeout` seconds to finish, the rest are cancelled (their clients get an
error event), then the server, the worker and the engine stop. Exit status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

from kvserve.services.cli_support import CliError, run_service, stop_on_signals
from kvserve.services.engine_options import (
    add_engine_arguments,
    check_engine_arguments,
    engine_config,
    load_engine,
)
from kvserve.services.gateway.main import (
    add_gateway_arguments,
    check_gateway_arguments,
    start_gateway,
)
from kvserve.shared.config import DEFAULT_STORE, STORE_FORMATS, default_model_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve the OpenAI-compatible API with an in-process engine (no Redis)"
    )
    p.add_argument("--model", default=str(default_model_path()), help="GGUF file or HF dir")
    p.add_argument(
        "--store",
        default=DEFAULT_STORE,
        help="prefix store URL: 'default' (memory + disk tier), memory://, file://DIR, "
        "redis://HOST:PORT/DB, or 'none'",
    )
    p.add_argument(
        "--store-format",
        choices=STORE_FORMATS,
        default="auto",
        help="block format in the store (auto: the KV cache's own: loads are exact)",
    )
    add_gateway_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    check_gateway_arguments(args)
    check_engine_arguments(args)
    return run_service(args, "serve", _serve)


async def _serve(args: argparse.Namespace) -> None:
    from kvserve.services.gateway.schema import load_model_info
    from kvserve.shared.bus.memory import InProcessBus
    from kvserve.shared.telemetry import get_logger

    log = get_logger("kvserve.serve")
    config = engine_config(args)
    info = await asyncio.to_thread(load_model_info, args.model, args.served_model_name)
    bus = InProcessBus()
    gateway, runner, port = await start_gateway(args, bus, info)
    url = f"http://{args.host}:{port}"
    log.info("listening", url=url, model=info.name)
    stop = stop_on_signals()
    load = asyncio.create_task(asyncio.to_thread(load_engine, config, info.tokenizer))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
    worker = None
    failed = None
    if load.done():
        worker = await _start_worker(bus, load.result(), url, config.store.url)
        failed = asyncio.create_task(worker.engine_failed.wait())
        await asyncio.wait({stopper, failed}, return_when=asyncio.FIRST_COMPLETED)
        if failed.done():  # /health says so until the process has exited
            gateway.context.readiness.dead = "the engine failed"
    log.info("shutting down", drain_timeout_s=args.drain_timeout)
    gateway.start_draining()
    drained = await gateway.admission.drained(args.drain_timeout)
    if worker is not None:
        # Whatever is still running after the drain timeout is cancelled now; its clients
        # get an error event before the server closes their connections.
        await worker.stop(drain_timeout=0.0 if not drained else 1.0)
        await gateway.admission.drained(5.0)
    await runner.cleanup()
    await _stop_engine(load)
    if failed is not None and failed.done():
        raise CliError("the engine failed; exiting for a supervisor to restart the server")
    log.info("stopped", drained=drained)


async def _start_worker(bus: Any, engine: Any, url: str, store: str | None) -> Any:
    """The engine's worker, registered on the bus (/ready turns 200)."""
    from kvserve.services.workers.engine_worker import EngineWorker
    from kvserve.shared.telemetry import get_logger

    worker = EngineWorker(bus.worker("engine-0"), engine)
    await worker.start()
    get_logger("kvserve.serve").info(
        "ready",
        url=url,
        store=store,
        startup_s={k: round(v, 4) for k, v in engine.startup_s.items()},
    )
    return worker


async def _stop_engine(load: asyncio.Task[Any]) -> None:
    """Stop the engine that `load` made, waiting for a load still under way."""
    if not load.done():
        load.cancel()
    engine = None
    with contextlib.suppress(BaseException):
        engine = await load
    if engine is not None:
        engine.close()
