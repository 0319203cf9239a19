"""KVEventPublisher: a worker's KV events, from its engine's tier log to the bus.

Every `interval_s` it takes what the engine logged (the engine thread appends; nothing here
runs on it), merges consecutive changes of the same kind and tier into one event (at most
`max_hashes` hashes each), numbers them `seq` = 0, 1, 2, ... for this incarnation and publishes
them in one pipeline. A failed publish loses those events but not their numbers, so a router
sees the gap and asks for a snapshot (services/gateway/router.py); every `resync_every`
flushes the publisher checks for such a request and has the engine log one (a "cleared", then
every block it holds), on the engine thread so that it is in order with the other changes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from kvserve.shared.bus.base import WorkerPort
from kvserve.shared.engine.kv.events import TierEvent, TierLog
from kvserve.shared.protocol import KVEvent
from kvserve.shared.tasks import cancel_and_wait
from kvserve.shared.telemetry import get_logger

log = get_logger("kvserve.worker")


def merge(events: list[TierEvent], max_hashes: int = 512) -> list[TierEvent]:
    """Consecutive events of one kind and tier as one (bounded); order kept."""
    out: list[TierEvent] = []
    for e in events:
        last = out[-1] if out else None
        if (
            last is not None
            and e.kind != "cleared"
            and (last.kind, last.tier) == (e.kind, e.tier)
            and len(last.hashes) + len(e.hashes) <= max_hashes
        ):
            out[-1] = TierEvent(e.kind, e.tier, last.hashes + e.hashes)
        else:
            out.append(e)
    return out


class KVEventPublisher:
    def __init__(
        self,
        port: WorkerPort,
        log: TierLog,
        incarnation: str,
        snapshot: Callable[[], Awaitable[Any]] | None = None,
        interval_s: float = 0.05,
        resync_every: int = 20,
    ) -> None:
        self.port = port
        self.tier_log = log
        self.incarnation = incarnation
        self.interval_s = interval_s
        self.snapshot = snapshot
        self.resync_every = resync_every
        self.snapshots = 0
        self.seq = 0
        self.published = 0
        self.failed = 0
        self._task: asyncio.Task[None] | None = None
        log.enable()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-events")

    async def stop(self) -> None:
        """Publish what is left, then stop."""
        if self._task is not None:
            await cancel_and_wait(self._task)
        with contextlib.suppress(Exception):
            await self.flush()

    async def _run(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(self.interval_s)
            n += 1
            if self.snapshot is not None and n % self.resync_every == 0:
                await self._resync_if_asked()
            await self.flush()

    async def _resync_if_asked(self) -> None:
        assert self.snapshot is not None
        try:
            if await self.port.resync_requested():
                await self.snapshot()
                self.snapshots += 1
        except Exception as e:  # the router asks again on its next gap
            log.warning("KV snapshot failed", error=str(e))

    async def flush(self) -> None:
        events = [self._numbered(e) for e in merge(self.tier_log.take())]
        if not events:
            return
        try:
            await self.port.publish_kv_events(events)
            self.published += len(events)
        except Exception as e:  # the router sees the gap in seq
            self.failed += len(events)
            log.warning("KV events lost", events=len(events), error=str(e))

    def _numbered(self, e: TierEvent) -> KVEvent:
        event = KVEvent(
            worker=self.port.name,
            incarnation=self.incarnation,
            seq=self.seq,
            op=e.kind,
            tier=e.tier,
            block_hashes=[bytes(h) for h in e.hashes],
        )
        self.seq += 1
        return event
