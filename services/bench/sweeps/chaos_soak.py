"""`kvserve bench chaos --soak-min N`: the load without faults for N minutes; after each minute
the load pauses until the server is idle and the minute's figures are read (KV blocks in use,
the servers' RSS and open file descriptors, the connected clients of the Redis servers and the
memory each uses, the error lines logged, the requests' outcomes, the device cache's cached and
evicted blocks; with a Redis bus, every bus stream's length and its consumer groups' pending
entries, and their totals), then their least-squares slopes per minute."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from typing import Any

from kvserve.services.bench.lib.fleet import Fleet
from kvserve.services.bench.sweeps.chaos_redis import PREFIX, bus_streams
from kvserve.services.bench.sweeps.chaos_rig import Rig
from kvserve.services.bench.sweeps.chaos_target import idle

# What the slopes are taken of (those a target has: the bus's only with a Redis bus).
SLOPES = ("rss_mb", "fds", "redis_clients", "used_blocks", "store_used_mb", "bus_used_mb",
          "stream_len", "pending")  # fmt: skip
OUT = f"{PREFIX}:out:"


def errors_logged(fleet: Fleet) -> int:
    """Lines at level error (structlog JSON) or with a traceback in the servers' logs."""
    n = 0
    for p in fleet:
        if p.log is None or not p.log.exists():
            continue
        for line in p.log.read_text(errors="replace").splitlines():
            n += '"level": "error"' in line or line.startswith("Traceback")
    return n


def slope(ys: list[float]) -> float:
    """Least-squares slope of ys against 0, 1, 2, ... (per minute)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


def _redis(rig: Rig) -> dict[str, Any]:
    """Each Redis server's memory used, their connected clients, and with a bus every bus
    stream's length and pending entries (`streams`) and their totals."""
    row: dict[str, Any] = {
        "redis_clients": sum(int(n.info("clients").get("connected_clients", 0)) for n in rig.redis)
    }
    for n in rig.redis:
        row[f"{n.role}_used_mb"] = n.used_mb()
    if rig.bus is not None:
        streams = bus_streams(rig.bus)
        row["stream_len"] = sum(s["len"] for s in streams.values())
        row["pending"] = sum(s["pending"] for s in streams.values())
        row["streams"] = fold_out(streams)
    return row


def fold_out(streams: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The per-request token-event streams (`kvserve:out:ID`, hundreds) as one entry
    `kvserve:out:*` with their count; every other stream as it is."""
    out = {k: v for k, v in streams.items() if not k.startswith(OUT)}
    events = [v for k, v in streams.items() if k.startswith(OUT)]
    if events:
        out[OUT + "*"] = {
            "len": sum(v["len"] for v in events),
            "pending": sum(v["pending"] for v in events),
            "streams": len(events),
        }
    return out


async def _minute(rig: Rig, m: int) -> dict[str, Any]:
    """Minute m of load, then the figures once the server is idle."""
    load, target = rig.load, rig.target
    load.phase, load.running = f"soak:{m}", True
    await asyncio.sleep(60)
    await load.drain()
    stats = await idle(target)
    outcomes = Counter(o.result for o in load.outcomes if o.phase == f"soak:{m}")
    totals = stats.get("totals") or {}
    return {
        "minute": m + 1,
        "used_blocks": int(totals.get("num_used_blocks", -1)),
        "cached_blocks": int(totals.get("cached_blocks", -1)),
        "evicted_blocks": int(totals.get("evicted_blocks", -1)),
        "rss_mb": target.rss_mb(),
        "fds": target.fleet.open_fds(),
        **await asyncio.to_thread(_redis, rig),
        "errors_logged": errors_logged(target.fleet),
        "outcomes": dict(outcomes),
    }


async def run_soak(rig: Rig, args: argparse.Namespace) -> dict[str, Any]:
    """The load without faults for --soak-min minutes, read after each (evicted blocks fill
    the bounded host tier, which RSS shows until it is full)."""
    minutes: list[dict[str, Any]] = []
    for m in range(args.soak_min):
        row = await _minute(rig, m)
        minutes.append(row)
        print(f"[{rig.target.kind}] soak {json.dumps(row)}", flush=True)
    return {
        "minutes": minutes,
        "slopes_per_min": {
            k: slope([float(row[k]) for row in minutes]) for k in SLOPES if k in minutes[0]
        },
    }
