"""The counters a chaos fault is judged by besides its requests' outcomes, read before the fault
and again once the server is idle after it: the front's `kvserve:stream_stalls_total` and
`kvserve:bus_dropped_messages_total{stream, reason}` (the gateway's /metrics carries every
worker's drops too), each Redis's evicted keys, and the "request taken over by another worker"
lines that the process a worker-stop stops has logged.

A counter the server does not expose reads as None, and so does its difference."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.sweeps.chaos_report import FaultReport

if TYPE_CHECKING:
    from kvserve.services.bench.sweeps.chaos_rig import Rig

STALLS = "kvserve:stream_stalls"
DROPPED = "bus_dropped_messages"  # kvserve:bus_dropped_messages_total, whatever its prefix
TAKEN_OVER = "request taken over by another worker"
# The process worker-stop stops: one that holds requests another can take over.
STOPS = {"serve": "serve", "fleet": "worker-1", "disagg": "decode-1"}


@dataclass(frozen=True)
class Counters:
    stalls: float | None
    dropped: dict[str, float] | None  # "stream/reason": n, summed over workers
    evicted: dict[str, int | None]  # Redis role: evicted_keys
    taken_over: int


def counter(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float] | None:
    """The samples of the counter family whose name ends with `name` (its `_total` samples,
    by label set) in Prometheus text; None when no such family is exposed."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[tuple[tuple[str, str], ...], float] | None = None
    for family in text_string_to_metric_families(text):
        if not family.name.endswith(name):
            continue
        found = found if found is not None else {}
        for s in family.samples:
            if s.name.endswith("_total"):
                key = tuple(sorted(s.labels.items()))
                found[key] = found.get(key, 0.0) + s.value
    return found


def _metrics(base_url: str) -> str:
    try:
        reply = Http(base_url, timeout=10).get("/metrics")
    except OSError:
        return ""
    return reply.text if reply.status_code == 200 else ""


def _dropped(text: str) -> dict[str, float] | None:
    samples = counter(text, DROPPED)
    if samples is None:
        return None
    out: dict[str, float] = {}
    for labels, v in samples.items():
        d = dict(labels)
        key = f"{d.get('stream', '?')}/{d.get('reason', '?')}"
        out[key] = out.get(key, 0.0) + v
    return out


def _taken_over(rig: Rig) -> int:
    proc = rig.target.procs.get(STOPS[rig.target.kind])
    return sum(TAKEN_OVER in line for line in proc.lines()) if proc is not None else 0


def read_sync(rig: Rig) -> Counters:
    text = _metrics(rig.target.base_url)
    stalls = counter(text, STALLS)
    return Counters(
        stalls=sum(stalls.values()) if stalls is not None else None,
        dropped=_dropped(text),
        evicted={n.role: n.evicted_keys() for n in rig.redis},
        taken_over=_taken_over(rig),
    )


async def read(rig: Rig) -> Counters:
    return await asyncio.to_thread(read_sync, rig)


def _grew(before: int | None, after: int | None) -> int | None:
    """after - before; a Redis restarted meanwhile counts from 0 again: after."""
    if before is None or after is None:
        return after
    return after - before if after >= before else after


def fill(rep: FaultReport, before: Counters, after: Counters, kind: str) -> None:
    """The report's counters: what grew from `before` to `after`."""
    if before.stalls is not None and after.stalls is not None:
        rep.stream_stalls = round(after.stalls - before.stalls)
    if before.dropped is not None and after.dropped is not None:
        by = {k: round(v - before.dropped.get(k, 0.0)) for k, v in after.dropped.items()}
        rep.bus_dropped_by = {k: n for k, n in sorted(by.items()) if n}
        rep.bus_dropped = sum(rep.bus_dropped_by.values())
    rep.evicted_keys = {
        role: n
        for role, n in ((r, _grew(before.evicted.get(r), v)) for r, v in after.evicted.items())
        if n is not None
    }
    # `serve` runs its own requests: nobody can take one over.
    rep.taken_over = after.taken_over - before.taken_over if kind != "serve" else None
