"""The faults of `kvserve bench chaos` (what each does: sweeps/chaos.py, the command's
--help) and one fault's run.

`inject` starts a fault, holds it for `--fault-s` and returns what ends it (a restart, a
signal, a setting put back). `run_fault`: `--calm-s` of load, the fault, `--recover-s` of
load, then the load pauses until the server is idle, and blocks, RSS and the fault's counters
(chaos_counters.py) are read; a Rig is what they act on. The Redis faults and the network
faults act on every Redis of the rig (the bus and the store) at once; `skip_reason` says why a
fault does not apply to a topology.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from typing import Any

from kvserve.services.bench.sweeps import chaos_counters
from kvserve.services.bench.sweeps.chaos_counters import STOPS
from kvserve.services.bench.sweeps.chaos_garbage import inject_garbage, remove_garbage
from kvserve.services.bench.sweeps.chaos_load import KINDS, QUESTIONS
from kvserve.services.bench.sweeps.chaos_redis import RedisNode
from kvserve.services.bench.sweeps.chaos_report import FaultReport
from kvserve.services.bench.sweeps.chaos_rig import Rig
from kvserve.services.bench.sweeps.chaos_slow_reader import slow_readers
from kvserve.services.bench.sweeps.chaos_target import Target, idle

REDIS_FAULTS = ("redis-kill", "redis-pause", "redis-oom")
NET_FAULTS = ("net-delay", "net-cut", "net-blackhole")
KILLS = {"worker-kill": "worker-1", "prefill-kill": "prefill-1", "decode-kill": "decode-1"}
NEW_FAULTS = ("poison-raise", "poison-kill", "worker-stop", "slow-reader", "bad-message",
              "redis-full")  # fmt: skip
FAULTS = (*REDIS_FAULTS, *NET_FAULTS, *KILLS, "gateway-term", "client-disconnect", "burst",
          *NEW_FAULTS)  # fmt: skip

IN_FLIGHT = 4  # greedy streams under way when worker-stop strikes

End = Callable[[], object]  # what ends a fault


def skip_reason(fault: str, target: Target) -> str | None:
    """Why `fault` does not apply to `target`; None when it does."""
    if fault in KILLS and KILLS[fault] not in target.procs:
        return f"no {KILLS[fault]} in {target.kind}"
    if target.kind == "serve" and fault == "bad-message":
        return "serve's bus is in its process: no Redis bus to write to"
    if target.kind == "serve" and fault == "poison-kill":
        return "serve has no other worker to take the request over"
    return None


async def _redis_kill(rig: Rig, secs: float) -> End:
    for n in rig.redis:
        n.server.kill()
    await asyncio.sleep(secs)

    def restart() -> None:  # empty, on the same ports
        for n in rig.redis:
            n.server.restart()

    return restart


async def _redis_pause(rig: Rig, secs: float) -> End:
    for n in rig.redis:
        n.server.signal(signal.SIGSTOP)
    await asyncio.sleep(secs)

    def resume() -> None:
        for n in rig.redis:
            n.server.signal(signal.SIGCONT)

    return resume


def _bound(node: RedisNode, headroom: int, policy: str | None = None) -> End:
    """maxmemory at what the server uses now (+ headroom), with `policy` if given; returns
    what puts the settings back."""
    r = node.client()
    old = {**r.config_get("maxmemory"), **r.config_get("maxmemory-policy")}
    used = int(r.info("memory")["used_memory"])
    if policy is not None:
        r.config_set("maxmemory-policy", policy)
    r.config_set("maxmemory", str(used + headroom))

    def restore() -> None:
        r.config_set("maxmemory", old["maxmemory"])
        r.config_set("maxmemory-policy", old["maxmemory-policy"])
        r.close()

    return restore


async def _redis_oom(rig: Rig, secs: float) -> End:
    restores = [_bound(n, 1 << 20, "noeviction") for n in rig.redis]
    await asyncio.sleep(secs)
    return lambda: [restore() for restore in restores]


async def _redis_full(rig: Rig, secs: float) -> End:
    """The store at the memory it uses now, still allkeys-lru: it evicts to stay there."""
    restore = _bound(rig.store, 0)
    await asyncio.sleep(secs)
    return restore


async def _net(rig: Rig, fault: str, secs: float) -> End:
    proxies = [n.proxy for n in rig.redis if n.proxy is not None]
    for p in proxies:
        if fault == "net-delay":
            p.set_delay(0.05)
        elif fault == "net-cut":
            p.cut()
        else:
            p.set_blackhole(True)
    await asyncio.sleep(secs)

    def heal() -> None:
        for p in proxies:
            p.set_delay(0.0)
            p.set_blackhole(False)

    return heal


async def _kill_restart(rig: Rig, name: str, sig: int, secs: float) -> End:
    proc = rig.target.procs[name]
    proc.signal(sig)
    await asyncio.to_thread(proc.reap, 60)
    await asyncio.sleep(secs)
    return proc.spawn


async def _worker_stop(rig: Rig, secs: float) -> End:
    """SIGSTOP once IN_FLIGHT greedy streams are under way: the stopped process likely holds
    some of them."""
    proc = rig.target.procs[STOPS[rig.target.kind]]
    await rig.load.streaming(IN_FLIGHT)
    proc.signal(signal.SIGSTOP)
    await asyncio.sleep(secs)
    return lambda: proc.signal(signal.SIGCONT)


async def _client_disconnect(rig: Rig, secs: float) -> End:
    drops = [rig.load.one("stream-greedy", q, drop_after_first=True) for q in range(8)]
    await asyncio.gather(*drops, asyncio.sleep(secs))
    return lambda: None


async def _burst(rig: Rig, secs: float) -> End:
    n = 4 * rig.load.args.max_queue
    burst = [rig.load.one("plain-greedy", q % len(QUESTIONS)) for q in range(n)]
    await asyncio.gather(asyncio.gather(*burst), asyncio.sleep(secs))
    return lambda: None


async def _poison_raise(rig: Rig, secs: float) -> End:
    """One request of each kind that raises in its own processing, spread over the window."""
    for i, kind in enumerate(KINDS):
        rig.load.start(kind, i % len(QUESTIONS), fault="raise")
        await asyncio.sleep(secs / len(KINDS))
    return lambda: None


async def _poison_kill(rig: Rig, secs: float) -> End:
    """One request that SIGKILLs each worker that runs it (the supervisor restarts them)."""
    rig.load.start("plain-greedy", 0, fault="kill")
    await asyncio.sleep(secs)
    return lambda: None


async def _bad_message(rig: Rig, secs: float) -> End:
    assert rig.bus is not None
    r = rig.bus.client()
    workers = [name for name in rig.target.procs if name != rig.target.front]
    await rig.load.streaming(2)  # token-event streams in use to write garbage into
    await asyncio.to_thread(inject_garbage, r, rig.target.kind, workers)
    await asyncio.sleep(secs)

    def end() -> None:
        remove_garbage(r)
        r.close()

    return end


async def _slow_reader(rig: Rig, secs: float) -> End:
    await slow_readers(rig, secs)
    return lambda: None


INJECT: dict[str, Callable[[Rig, float], Any]] = {
    "redis-kill": _redis_kill,
    "redis-pause": _redis_pause,
    "redis-oom": _redis_oom,
    "redis-full": _redis_full,
    "worker-stop": _worker_stop,
    "client-disconnect": _client_disconnect,
    "burst": _burst,
    "poison-raise": _poison_raise,
    "poison-kill": _poison_kill,
    "bad-message": _bad_message,
    "slow-reader": _slow_reader,
}


async def inject(rig: Rig, fault: str, secs: float) -> End:
    """Start the fault and hold it `secs`; returns what ends it."""
    if fault in NET_FAULTS:
        return await _net(rig, fault, secs)
    if fault in KILLS:
        return await _kill_restart(rig, KILLS[fault], signal.SIGKILL, secs)
    if fault == "gateway-term":
        return await _kill_restart(rig, rig.target.front, signal.SIGTERM, secs)
    end: End = await INJECT[fault](rig, secs)
    return end


def _ended_by(rig: Rig, fault: str) -> str | None:
    """The process the fault itself ends and restarts (the supervisor leaves it alone)."""
    if fault in KILLS:
        return KILLS[fault]
    return rig.target.front if fault == "gateway-term" else None


async def _store_back(rig: Rig, since: int, timeout: float = 60.0) -> float | None:
    """Seconds until the store holds more blocks than `since`, its count when the fault
    began (0 for a Redis that restarted empty); None: not within `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await asyncio.to_thread(rig.store.stored_blocks) > since:
            return time.monotonic() - t0
        await asyncio.sleep(0.25)
    return None


async def _fault_and_recovery(rig: Rig, fault: str, args: argparse.Namespace) -> float | None:
    """The fault held and ended, the target ready again, --recover-s of load; the seconds until
    the store took writes again (Redis and network faults)."""
    stored = 0 if fault == "redis-kill" else await asyncio.to_thread(rig.store.stored_blocks)
    ended = _ended_by(rig, fault)
    with rig.supervisor.hold(ended) if ended else contextlib.nullcontext():
        end = await inject(rig, fault, args.fault_s)
        await asyncio.to_thread(end)
    back = None
    if fault in REDIS_FAULTS + NET_FAULTS:
        back = asyncio.create_task(_store_back(rig, stored))
    if ended:
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
    t0 = time.monotonic()
    load.phase, load.running = f"calm:{fault}", True
    await asyncio.sleep(args.calm_s)
    before = await chaos_counters.read(rig)
    load.phase, fault_start = fault, time.monotonic() - load.t0
    rep.store_back_s = await _fault_and_recovery(rig, fault, args)
    if rig.supervisor.since(t0):  # restarted processes: serving again before the next fault
        await asyncio.to_thread(target.wait_ready)
    after = await idle(target)
    rep.used_blocks_after = int((after.get("totals") or {}).get("num_used_blocks", -1))
    rep.rss_growth_mb = target.rss_mb() - rss0
    rep.count(load.outcomes, fault_start)
    chaos_counters.fill(rep, before, await chaos_counters.read(rig), target.kind)
    rep.died = [d.name for d in rig.supervisor.since(t0)]
    rep.workers_lost = len(rep.died)
    return rep
