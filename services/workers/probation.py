"""Probation: how a worker takes over requests whose worker died, so that a request that kills
its workers is quarantined before it costs the fleet more than `quarantine_after` of them, and
the requests that merely died beside it are not.

A taken-over request (a redelivery) runs on probation: one at a time per worker, from its
admission to its first output (a prefill worker: to its end), with the probation recorded on
the bus under this worker's incarnation. A worker that dies meanwhile leaves that record behind;
whoever takes the request over next turns it into a strike (`WorkerPort.strikes`). A request's
deaths are its first run's (it was taken over, so its first worker died) plus its strikes; at
`quarantine_after` it is failed to its client with code "quarantined" and never run again.

Since only the request on probation is blamed, a request that was merely running beside a
killer when its worker died is not: it is taken over again later and finishes. The cost is that
one worker resumes a dead worker's requests one first step at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable

from kvserve.shared.bus.base import Delivery, WorkerPort
from kvserve.shared.tasks import cancel_and_wait
from kvserve.shared.telemetry import get_logger

log = get_logger("kvserve.worker")

Start = Callable[[Delivery], "asyncio.Task[None]"]
Quarantine = Callable[[Delivery, int], Awaitable[None]]


class Probation:
    """The worker's queue of taken-over deliveries (owned here until started); `current` is
    the request on probation now."""

    def __init__(
        self, port: WorkerPort, quarantine_after: int, start: Start, quarantine: Quarantine
    ) -> None:
        self.port = port
        self.quarantine_after = quarantine_after
        self._start = start
        self._quarantine = quarantine
        self._queue: deque[Delivery] = deque()
        self._task: asyncio.Task[None] | None = None
        self.current: str | None = None
        self._passed = asyncio.Event()

    def submit(self, d: Delivery) -> None:
        self._queue.append(d)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="worker-probation")

    def first_output(self, request_id: str) -> None:
        """The request produced its first output: its probation has passed."""
        if request_id == self.current:
            self._passed.set()

    async def stop(self) -> None:
        """Stop starting deliveries; those still queued stay pending for another worker."""
        if self._task is not None:
            await cancel_and_wait(self._task)
        self._queue.clear()

    async def _run(self) -> None:
        while self._queue:
            d = self._queue.popleft()
            rid = d.request.request_id
            deaths = 1 + await self._strikes(rid)
            if deaths >= self.quarantine_after:
                await self._quarantine(d, deaths)
                continue
            with contextlib.suppress(Exception):  # without the record, no strike: a backstop
                await self.port.begin_probation(rid)  # (the bus's max_deliveries) remains
            self.current, self._passed = rid, asyncio.Event()
            passed = asyncio.create_task(self._passed.wait())
            try:
                await asyncio.wait([self._start(d), passed], return_when=asyncio.FIRST_COMPLETED)
            finally:
                passed.cancel()
                self.current = None
            with contextlib.suppress(Exception):
                await self.port.end_probation(rid)

    async def _strikes(self, request_id: str) -> int:
        try:
            return await self.port.strikes(request_id)
        except Exception:  # the bus is down: run it (the bus's delivery bound still holds)
            log.warning("cannot read a taken-over request's strikes", request_id=request_id)
            return 0
