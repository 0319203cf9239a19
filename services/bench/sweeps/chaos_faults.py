"""The faults of `kvserve bench chaos` (what each does: sweeps/chaos.py, the command's
--help) and one fault's run.

`inject` starts a fault, holds it for `--fault-s` and returns what ends it (a restart, a
signal, a setting put back). `run_fault`: `--calm-s` of load, the fault, `--recover-s` of
load, then the load pauses until the server is idle, and blocks and RSS are read; a Rig is what
they act on.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.services.bench.lib.redis_server import RedisServer
from kvserve.services.bench.lib.tcp_proxy import ThreadedFaultProxy
from kvserve.services.bench.sweeps.chaos_load import QUESTIONS, Load
from kvserve.services.bench.sweeps.chaos_report import FaultReport
from kvserve.services.bench.sweeps.chaos_target import Target, idle

REDIS_FAULTS = ("redis-kill", "redis-pause", "redis-oom")
NET_FAULTS = ("net-delay", "net-cut", "net-blackhole")
KILLS = {"worker-kill": "worker-1", "prefill-kill": "prefill-1", "decode-kill": "decode-1"}
FAULTS = (*REDIS_FAULTS, *NET_FAULTS, *KILLS, "gateway-term", "client-disconnect", "burst")
BLOCK_KEYS = "kvserve:v1:blk:*"  # the Redis store's block keys (default namespace)

End = Callable[[], object]  # what ends a fault


@dataclass
class Rig:
    """What the faults act on: the Redis, the proxy in front of it, the target, the load."""

    redis: RedisServer
    proxy: ThreadedFaultProxy
    target: Target
    load: Load

    def redis_client(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(port=self.redis.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))

    def stored_blocks(self) -> int:
        """Store blocks in Redis now (asked directly, not through the proxy)."""
        r = self.redis_client()
        try:
            return sum(1 for _ in r.scan_iter(match=BLOCK_KEYS, count=1000))
        except Exception:  # Redis down or paused: none to be seen
            return 0
        finally:
            r.close()


async def _redis_kill(rig: Rig, secs: float) -> End:
    rig.redis.kill()
    await asyncio.sleep(secs)
    return rig.redis.restart  # empty, on the same port


async def _redis_pause(rig: Rig, secs: float) -> End:
    rig.redis.signal(signal.SIGSTOP)
    await asyncio.sleep(secs)
    return lambda: rig.redis.signal(signal.SIGCONT)


async def _redis_oom(rig: Rig, secs: float) -> End:
    r = rig.redis_client()
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", str(used + (1 << 20)))
    await asyncio.sleep(secs)

    def restore() -> None:
        r.config_set("maxmemory", rig.redis.maxmemory or "0")
        r.config_set("maxmemory-policy", "allkeys-lru")
        r.close()

    return restore


async def _net(rig: Rig, fault: str, secs: float) -> End:
    p = rig.proxy
    if fault == "net-delay":
        p.set_delay(0.05)
    elif fault == "net-cut":
        p.cut()
    else:
        p.set_blackhole(True)
    await asyncio.sleep(secs)

    def heal() -> None:
        p.set_delay(0.0)
        p.set_blackhole(False)

    return heal


async def _kill_restart(rig: Rig, name: str, sig: int, secs: float) -> End:
    proc = rig.target.procs[name]
    proc.signal(sig)
    await asyncio.to_thread(proc.reap, 60)
    await asyncio.sleep(secs)
    return proc.spawn


async def _client_disconnect(rig: Rig, secs: float) -> End:
    drops = [rig.load.one("stream-greedy", q, drop_after_first=True) for q in range(8)]
    await asyncio.gather(*drops, asyncio.sleep(secs))
    return lambda: None


async def _burst(rig: Rig, secs: float) -> End:
    n = 4 * rig.load.args.max_queue
    burst = [rig.load.one("plain-greedy", q % len(QUESTIONS)) for q in range(n)]
    await asyncio.gather(asyncio.gather(*burst), asyncio.sleep(secs))
    return lambda: None


async def inject(rig: Rig, fault: str, secs: float) -> End:
    """Start the fault and hold it `secs`; returns what ends it."""
    if fault == "redis-kill":
        return await _redis_kill(rig, secs)
    if fault == "redis-pause":
        return await _redis_pause(rig, secs)
    if fault == "redis-oom":
        return await _redis_oom(rig, secs)
    if fault in NET_FAULTS:
        return await _net(rig, fault, secs)
    if fault in KILLS:
        return await _kill_restart(rig, KILLS[fault], signal.SIGKILL, secs)
    if fault == "gateway-term":
        return await _kill_restart(rig, rig.target.front, signal.SIGTERM, secs)
    if fault == "client-disconnect":
        return await _client_disconnect(rig, secs)
    return await _burst(rig, secs)


async def _store_back(rig: Rig, since: int, timeout: float = 60.0) -> float | None:
    """Seconds until Redis holds more store blocks than `since`, its count when the fault
    began (0 for a Redis that restarted empty); None: not within `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await asyncio.to_thread(rig.stored_blocks) > since:
            return time.monotonic() - t0
        await asyncio.sleep(0.25)
    return None


async def _fault_and_recovery(rig: Rig, fault: str, args: argparse.Namespace) -> float | None:
    """The fault held and ended, the target ready again, --recover-s of load; the seconds until
    the store took writes again (Redis and network faults)."""
    stored = 0 if fault == "redis-kill" else await asyncio.to_thread(rig.stored_blocks)
    end = await inject(rig, fault, args.fault_s)
    await asyncio.to_thread(end)
    back = None
    if fault in REDIS_FAULTS + NET_FAULTS:
        back = asyncio.create_task(_store_back(rig, stored))
    if fault in KILLS or fault == "gateway-term":
        await asyncio.to_thread(rig.target.wait_ready)
    await asyncio.sleep(args.recover_s)
    await rig.load.drain()
    return await back if back is not None else None


async def run_fault(
    rig: Rig, fault: str, args: argparse.Namespace, base: dict[str, Any]
) -> FaultReport:
    """One fault under load, calm period first; its report."""
    load, target = rig.load, rig.target
    rep = FaultReport(fault, used_blocks_before=int(base["totals"].get("num_used_blocks", 0)))
    rss0 = target.rss_mb()
    load.phase, load.running = f"calm:{fault}", True
    await asyncio.sleep(args.calm_s)
    load.phase = fault
    rep.store_back_s = await _fault_and_recovery(rig, fault, args)
    after = await idle(target)
    rep.used_blocks_after = int((after.get("totals") or {}).get("num_used_blocks", -1))
    rep.rss_growth_mb = target.rss_mb() - rss0
    rep.count(load.outcomes)
    return rep
