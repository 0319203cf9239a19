"""`kvserve gateway`: the OpenAI-compatible gateway on the Redis bus, with no engine in the
process (it never imports torch). Each request goes to the worker that `--routing` picks (its
own stream; cache-aware by default, from the workers' KV events), or to the shared
`kvserve:prefill` consumer group while no worker is known; /ready is 200 while any worker is
alive. SIGTERM/SIGINT: drain like `kvserve serve`, then exit 0.

Also the gateway options and start-up that `kvserve serve` shares."""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any

from kvserve.services.cli_support import (
    CliError,
    check_at_least_one,
    check_bus_url,
    check_port,
    check_positive,
    run_service,
    stop_on_signals,
)
from kvserve.services.engine_options import add_fault_injection_argument
from kvserve.services.gateway.config import GatewayConfig
from kvserve.services.gateway.router import DEFAULT_STORE_COST, POLICIES
from kvserve.shared.config import default_model_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="the OpenAI-compatible gateway on the Redis bus (no engine)")
    p.add_argument("--bus", required=True, help="redis://HOST:PORT/DB of the request bus")
    p.add_argument("--model", default=str(default_model_path()), help="for the tokenizer only")
    p.add_argument("--routing", choices=POLICIES, default="cache-aware", help="worker choice")
    p.add_argument(
        "--overlap-weight",
        type=float,
        default=1.0,
        help="cache-aware cost = weight * blocks to prefill + the worker's load in blocks",
    )
    p.add_argument(
        "--router-store-cost",
        type=store_cost,
        default=DEFAULT_STORE_COST,
        metavar="C|auto",
        help="a block in the shared store costs this fraction of recomputing it (0..1); auto: "
        "each worker's own measured ratio (its store_load_cost)",
    )
    p.add_argument(
        "--router-max-blocks", type=int, default=100_000, help="hashes remembered per worker"
    )
    p.add_argument(
        "--pd-threshold",
        type=int,
        default=0,
        help="disaggregated topology: a request whose uncached part (as the router predicts "
        "it) is shorter than this many tokens goes straight to a decode worker, which computes "
        "it; 0: every request is prefilled by a prefill worker",
    )
    add_gateway_arguments(p)
    add_fault_injection_argument(p)
    p.add_argument("--log-level", default=None)
    p.set_defaults(handler=run)


def store_cost(text: str) -> float | None:
    """--router-store-cost: "auto" (None) or a fraction in [0, 1]."""
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not auto or a number in [0, 1]")
    return value


def add_gateway_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP front's options `serve` and `gateway` share."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (logged)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send")
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
    p.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a stream's write waits for a client that stopped reading; then the "
        "request is aborted (0: wait as long as the client takes)",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds, on SIGTERM")


def check_gateway_arguments(args: argparse.Namespace) -> None:
    check_port("--port", args.port)
    check_at_least_one(args, ("max_queue", "max_body_bytes"))
    check_positive(args, ("request_timeout", "drain_timeout"))
    if not args.stream_stall_timeout >= 0:
        raise CliError("--stream-stall-timeout must be >= 0")
    if any(not k for k in args.api_key):
        raise CliError("--api-key must not be empty")
    rate_limit(args.rate_limit)


def run(args: argparse.Namespace) -> int:
    check_bus_url(args.bus)
    check_gateway_arguments(args)
    check_at_least_one(args, ("router_max_blocks",))
    if args.overlap_weight < 0:
        raise CliError("--overlap-weight must be >= 0")
    if args.pd_threshold < 0:
        raise CliError("--pd-threshold must be >= 0")
    return run_service(args, "gateway", _serve)


# The router's options, each named for the GatewayConfig field it sets (`kvserve gateway` only).
ROUTER_OPTIONS = (
    "routing",
    "overlap_weight",
    "router_store_cost",
    "router_max_blocks",
    "pd_threshold",
)


async def _serve(args: argparse.Namespace) -> None:
    from kvserve.services.gateway.schema import load_model_info
    from kvserve.shared.bus.redis import RedisBus
    from kvserve.shared.bus.redis_layout import RedisBusConfig
    from kvserve.shared.telemetry import get_logger

    log = get_logger("kvserve.gateway")
    info = await asyncio.to_thread(load_model_info, args.model, args.served_model_name)
    # Every request in flight waits for its events on one connection; a burst of submits and
    # cancels takes one each while it runs (a bound, not a reservation).
    bus = RedisBus(args.bus, RedisBusConfig(max_connections=max(1024, 2 * args.max_queue)))
    routing = {name: getattr(args, name) for name in ROUTER_OPTIONS}
    gateway, runner, port = await start_gateway(args, bus, info, **routing)
    log.info("ready", url=f"http://{args.host}:{port}", model=info.name)
    stop = stop_on_signals()
    await stop.wait()
    log.info("shutting down", drain_timeout_s=args.drain_timeout)
    gateway.start_draining()
    drained = await gateway.admission.drained(args.drain_timeout)
    await runner.cleanup()
    await bus.close()
    log.info("stopped", drained=drained)


async def start_gateway(
    args: argparse.Namespace, bus: Any, info: Any, **routing: Any
) -> tuple[Any, Any, int]:
    """The gateway built from the options `serve` and `gateway` share (and `routing`: the
    router's GatewayConfig fields, `kvserve gateway`'s only), listening on --host/--port:
    (gateway, its aiohttp runner, the bound port). CliError if it cannot listen."""
    from aiohttp import web
    from kvserve.services.gateway.app import Gateway

    gateway = Gateway(gateway_config(args, **routing), bus, info)
    runner = web.AppRunner(gateway.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e}") from e
    port = next(
        (int(a[1]) for a in runner.addresses if isinstance(a, tuple) and len(a) >= 2),
        args.port,
    )
    return gateway, runner, port


def gateway_config(args: argparse.Namespace, **routing: Any) -> GatewayConfig:
    """The GatewayConfig of the options `serve` and `gateway` share: the limits, then the API
    keys; with `routing`, the router's fields."""
    return GatewayConfig(
        max_in_flight=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout,
        stream_stall_timeout_s=args.stream_stall_timeout,
        rate_limit=rate_limit(args.rate_limit),
        api_keys=tuple(args.api_key),
        allow_client_cache_salt=args.allow_client_cache_salt,
        fault_injection=args.enable_fault_injection,
        **routing,
    )


def rate_limit(spec: str | None) -> float:
    """--rate-limit N/s or N/m -> requests per second (0: no limit)."""
    from kvserve.services.gateway.ratelimit import parse_rate

    if spec is None:
        return 0.0
    try:
        return parse_rate(spec)
    except ValueError as e:
        raise CliError(f"--rate-limit: {e}") from e
