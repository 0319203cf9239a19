"""`kvserve sim-fleet`: many simulated engine workers in one process, on the Redis bus (DESIGN.md
section 2.2), for a fleet larger than the machine's cores and memory hold as `kvserve worker`
processes.

Each is the production worker (`EngineWorker`, or the disaggregated `PrefillWorker` /
`DecodeWorker`) over a simulated engine (`--profile`: its forward pass takes the profile's
time; bus, scheduler, KV-cache manager, store frames, KV events and take-over are the real
code). They share one event loop, one Redis connection pool and the tokenizer; each engine
steps on a thread of its own. Workers are named `{prefix}-{i}` (aggregated) or
`{prefix}-prefill-{i}` and `{prefix}-decode-{i}`. SIGTERM / Ctrl-C drains and stops them all.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from kvserve.services.cli_support import CliError, check_bus_url, check_positive, run_service
from kvserve.services.engine_options import check_sim_arguments
from kvserve.shared.config import SIM_PAYLOADS, STORE_FORMATS, default_model_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-fleet", help="many simulated engine workers in one process")
    p.add_argument("--bus", required=True, help="redis://HOST:PORT/DB of the request bus")
    p.add_argument("--store", required=True, help="prefix store URL (redis://HOST:PORT/DB)")
    p.add_argument("--profile", required=True, help="cost profile: gpu, cpu, or a file")
    p.add_argument("--workers", type=int, default=0, help="aggregated workers")
    p.add_argument("--prefill", type=int, default=0, help="prefill workers (disaggregated)")
    p.add_argument("--decode", type=int, default=0, help="decode workers (disaggregated)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="run this many times slower than modelled")  # fmt: skip
    p.add_argument("--sim-payload", choices=SIM_PAYLOADS, default="auto")
    p.add_argument("--store-format", choices=STORE_FORMATS, default="auto")
    p.add_argument("--name-prefix", default="sim", help="worker names start with it")
    p.add_argument("--claim-idle", type=float, default=30.0,
                   help="seconds after which a dead worker's request is claimed")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds, on SIGTERM")
    p.add_argument("--model", default=str(default_model_path()), help="for the tokenizer only")
    p.add_argument("--log-level", default=None)
    p.set_defaults(handler=run, simulate=None)


def worker_names(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(role, name) of every worker, in start order."""
    p = args.name_prefix
    if args.workers:
        return [("worker", f"{p}-{i}") for i in range(args.workers)]
    return [("prefill", f"{p}-prefill-{i}") for i in range(args.prefill)] + [
        ("decode", f"{p}-decode-{i}") for i in range(args.decode)
    ]


def _check(args: argparse.Namespace) -> None:
    check_bus_url(args.bus)
    if min(args.workers, args.prefill, args.decode) < 0:
        raise CliError("--workers, --prefill and --decode must be >= 0")
    if args.workers and (args.prefill or args.decode):
        raise CliError("--workers is the aggregated topology; --prefill/--decode the other")
    if not args.workers and not (args.prefill and args.decode):
        raise CliError("give --workers N, or both --prefill P and --decode D")
    if args.store == "none":
        raise CliError("--store must name a store (redis://... to share blocks, or memory://)")
    check_positive(args, ("claim_idle", "drain_timeout"))
    args.simulate = args.profile
    check_sim_arguments(args)


def run(args: argparse.Namespace) -> int:
    _check(args)
    return run_service(args, "sim-fleet", _work)


def _engine_config(args: argparse.Namespace) -> object:
    from kvserve.shared.config import EngineConfig, SimConfig, StoreConfig

    sim = SimConfig(args.profile, time_scale=args.time_scale, payload=args.sim_payload)
    store = StoreConfig(url=args.store, format=args.store_format)
    # One torch thread: the engines compute nothing, and each of their few small tensor
    # operations would otherwise start a team of threads, dozens of engines at once.
    return EngineConfig(model_path=args.model, store=store, simulate=sim, num_threads=1)


async def _work(args: argparse.Namespace) -> None:
    import redis.asyncio as aioredis
    from kvserve.services.cli_support import stop_on_signals
    from kvserve.services.engine_options import load_engine
    from kvserve.services.worker_commands import make_worker
    from kvserve.shared.bus.redis_layout import RedisBusConfig
    from kvserve.shared.model.tokenizer import KVTokenizer
    from kvserve.shared.telemetry import get_logger

    log = get_logger("kvserve.sim-fleet")
    stop = stop_on_signals()
    tokenizer = await asyncio.to_thread(KVTokenizer.from_path, args.model)
    config = _engine_config(args)
    cfg = RedisBusConfig()
    engines, workers, clients = [], [], []
    for role, name in worker_names(args):
        # A client (and connection pool) of its own per worker, as separate processes have:
        # one pool shared by dozens of busy workers runs out of connections.
        redis = aioredis.Redis.from_url(
            args.bus, socket_timeout=cfg.socket_timeout_s, max_connections=cfg.max_connections
        )
        engine = await asyncio.to_thread(load_engine, config, tokenizer)
        worker, _ = make_worker(args, role, name, engine, redis)
        clients.append(redis)
        worker.model_name = os.path.basename(args.model).split(".")[0]
        engines.append(engine)
        workers.append(worker)
    await asyncio.gather(*(w.start() for w in workers))
    log.info(
        "ready",
        workers=len(workers),
        simulation=engines[0].simulation,
        url=f"bus:{args.name_prefix}-*",
        pid=os.getpid(),
    )
    await stop.wait()
    log.info("shutting down", drain_timeout_s=args.drain_timeout)
    await asyncio.gather(*(w.stop(drain_timeout=args.drain_timeout) for w in workers))
    for engine in engines:
        await asyncio.to_thread(engine.close)
    for client in clients:
        await client.aclose()
    log.info("stopped")
