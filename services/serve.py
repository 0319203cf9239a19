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

from kvserve.services.cli import CliError, stop_on_signals
from kvserve.services.gateway.main import rate_limit, start_gateway
from kvserve.shared.config import (
    DEFAULT_STORE,
    KV_DTYPES,
    MATMUL_DTYPES,
    MODEL_DTYPES,
    POPULATE_MODES,
    STORE_FORMATS,
    default_model_path,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve the OpenAI-compatible API with an in-process engine (no Redis)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (logged)")
    p.add_argument("--model", default=str(default_model_path()), help="GGUF file or HF dir")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send")
    p.add_argument(
        "--store",
        default=DEFAULT_STORE,
        help="prefix store URL: 'default' (memory + disk tier), memory://, file://DIR, "
        "redis://HOST:PORT/DB, or 'none'",
    )
    p.add_argument(
        "--store-format", choices=STORE_FORMATS, default="native", help="block format in the store"
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require `Authorization: Bearer KEY` on /v1 (repeatable; one tenant per key)",
    )
    p.add_argument(
        "--allow-client-cache-salt",
        action="store_true",
        help="let clients narrow their key's cache partition with `cache_salt`",
    )
    p.add_argument("--max-queue", type=int, default=256, help="requests in flight before 503")
    p.add_argument(
        "--rate-limit",
        default=None,
        metavar="N/s",
        help="per API key (or client address): POST /v1 requests per second (N/s or N/m); "
        "over it: 429 with Retry-After",
    )
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds, on SIGTERM")
    add_engine_arguments(p)
    p.set_defaults(handler=run)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine options `serve`, `prefill` and `decode` share."""
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto")
    p.add_argument(
        "--kv-populate",
        choices=POPULATE_MODES,
        default="background",
        help="when the KV cache's memory becomes resident: before the engine serves (eager), "
        "while it serves (background), or as blocks are written (lazy)",
    )
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--attention-backend", choices=("auto", "torch", "cpu", "triton"), default="auto"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=MODEL_DTYPES, default="float32")
    p.add_argument(
        "--matmul-dtype",
        choices=MATMUL_DTYPES,
        default="auto",
        help="dtype of the linear layers' matmuls alone (auto: --dtype); bfloat16 with "
        "--dtype float32 uses the CPU's bf16 instructions, the KV cache stays float32",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the engine's compute (default: one per core)",
    )
    p.add_argument("--log-level", default=None)


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("max_queue", "max_body_bytes", "block_size", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_blocks is not None and args.num_blocks < 1:
        raise CliError("--num-blocks must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be >= 1")
    for name in ("request_timeout", "drain_timeout"):
        if getattr(args, name) <= 0:
            raise CliError(f"--{name.replace('_', '-')} must be > 0")
    if any(not k for k in args.api_key):
        raise CliError("--api-key must not be empty")
    rate_limit(args.rate_limit)


def run(args: argparse.Namespace) -> int:
    from kvserve.shared.telemetry import configure_logging, configure_tracing, shutdown_tracing

    _check(args)
    configure_logging(args.log_level)
    configure_tracing("kvserve-serve")
    try:
        asyncio.run(_serve(args))
    finally:
        shutdown_tracing()
    return 0


def engine_config(args: argparse.Namespace) -> Any:
    from kvserve.shared.config import CacheConfig, EngineConfig, SchedulerConfig, StoreConfig

    store = None if args.store == "none" else args.store
    try:
        return EngineConfig(
            model_path=args.model,
            dtype=args.dtype,
            matmul_dtype=args.matmul_dtype,
            device=args.device,
            attention_backend=args.attention_backend,
            num_threads=args.threads,
            cache=CacheConfig(
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                kv_dtype=args.kv_dtype,
                enable_prefix_caching=not args.no_prefix_caching,
                populate=args.kv_populate,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
            ),
            store=StoreConfig(url=store, format=args.store_format),
        )
    except ValueError as e:
        raise CliError(str(e)) from e


def _load_engine(config: Any, tokenizer: Any) -> Any:
    from kvserve.shared.engine.async_engine import AsyncEngine
    from kvserve.shared.engine.engine import Engine

    return AsyncEngine(Engine(config, tokenizer=tokenizer))


async def _serve(args: argparse.Namespace) -> None:
    from kvserve.services.gateway.schema import load_model_info
    from kvserve.services.worker import EngineWorker
    from kvserve.shared.bus import InProcessBus
    from kvserve.shared.telemetry import get_logger

    log = get_logger("kvserve.serve")
    config = engine_config(args)
    info = await asyncio.to_thread(load_model_info, args.model, args.served_model_name)
    bus = InProcessBus()
    gateway, runner, port = await start_gateway(args, bus, info)
    log.info("listening", url=f"http://{args.host}:{port}", model=info.name)

    stop = stop_on_signals()

    load = asyncio.create_task(asyncio.to_thread(_load_engine, config, info.tokenizer))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
    worker = None
    engine = None
    if load.done():
        engine = load.result()
        worker = EngineWorker(bus.worker("engine-0"), engine)
        await worker.start()
        log.info(
            "ready",
            url=f"http://{args.host}:{port}",
            store=config.store.url,
            startup_s={k: round(v, 4) for k, v in engine.engine.startup_s.items()},
        )
        await stopper
    log.info("shutting down", drain_timeout_s=args.drain_timeout)
    gateway.start_draining()
    drained = await gateway.admission.drained(args.drain_timeout)
    if worker is not None:
        # Whatever is still running after the drain timeout is cancelled now; its clients
        # get an error event before the server closes their connections.
        await worker.stop(drain_timeout=0.0 if not drained else 1.0)
        await gateway.admission.drained(5.0)
    await runner.cleanup()
    if engine is None:
        load.cancel()
        with contextlib.suppress(BaseException):
            engine = await load
    if engine is not None:
        engine.stop()
        close = getattr(engine.engine, "close", None)
        if close is not None:
            close()
    log.info("stopped", drained=drained)
