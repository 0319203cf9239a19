"""KVEventPublisher: a worker's KV events, from its KV-cache manager's tier log to the bus.

Every `interval_s` it takes what the manager logged (the engine thread appends; nothing here
runs on it), merges consecutive changes of the same kind and tier into one event (at most
`max_hashes` hashes each), numbers them `seq` = 0, 1, 2, ... for this incarnation and publishes
them in one pipeline. A failed publish loses those events but not their numbers, so a router
sees the gap and resynchronises (services/gateway/router.py).
"""

from __future__ import annotations

import asyncio
import contextlib

from kvserve.shared.bus import WorkerPort
from kvserve.shared.engine.kv_cache_manager import KVCacheManager, TierEvent
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
        manager: KVCacheManager,
        incarnation: str,
        interval_s: float = 0.05,
    ) -> None:
        self.port = port
        self.manager = manager
        self.incarnation = incarnation
        self.interval_s = interval_s
        self.seq = 0
        self.published = 0
        self.failed = 0
        self._task: asyncio.Task[None] | None = None
        manager.enable_events()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-events")

    async def stop(self) -> None:
        """Publish what is left, then stop."""
        if self._task is not None:
            await cancel_and_wait(self._task)
        with contextlib.suppress(Exception):
            await self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def flush(self) -> None:
        events = [self._numbered(e) for e in merge(self.manager.take_events())]
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
