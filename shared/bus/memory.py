"""InProcessBus: the bus on asyncio queues, for `kvserve serve` (gateway and worker on one event
loop). Requests and cancels still go through `encode` / `decode`, so what it accepts is exactly
what the Redis bus would. Token events, one per streamed token, are handed over as they are:
the worker builds each from fresh lists and never touches it again, and their msgpack round
trip was ~1/6 of the event loop's CPU per streamed token (docs/benchmarks.md, "Single-user
chat")."""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from typing import Any

from kvserve.shared.bus.base import Bus, Delivery, EventStream, StatsSource, WorkerPort
from kvserve.shared.protocol import (
    AdminRequest,
    Cancel,
    GenerateRequest,
    TokenEvent,
    Work,
    WorkerInfo,
    decode,
    encode,
)


class _BoundedSet:
    """Remembers the last `capacity` keys (cancelled request ids)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self._items: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def add(self, key: str) -> None:
        self._items[key] = None
        self._items.move_to_end(key)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        return key in self._items


class _QueueEventStream(EventStream):
    def __init__(self, bus: InProcessBus, request: Work) -> None:
        super().__init__(request)
        self._bus = bus
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    async def _receive(self) -> list[TokenEvent]:
        first = await self.queue.get()
        rest = []
        while not self.queue.empty():
            rest.append(self.queue.get_nowait())
        return [first, *rest]

    async def close(self) -> None:
        self._bus._streams.pop(self.request.request_id, None)


class InProcessBus(Bus):
    """Queues on one event loop (token events handed over as objects; the rest through
    `encode` / `decode`, as the module says)."""

    def __init__(self) -> None:
        self._requests: asyncio.Queue[bytes] = asyncio.Queue()
        self._streams: dict[str, _QueueEventStream] = {}
        self._ports: dict[str, _InProcessPort] = {}
        self._cancelled = _BoundedSet()

    async def submit(self, request: Work, worker: str | None = None) -> EventStream:
        stream = _QueueEventStream(self, request)
        self._streams[request.request_id] = stream
        self._requests.put_nowait(encode(request))
        return stream

    async def send(self, request: Work, worker: str | None = None) -> None:
        self._requests.put_nowait(encode(request))

    async def cancel(self, request_id: str, reason: str = "client") -> None:
        self._cancelled.add(request_id)
        data = encode(Cancel(request_id, reason))
        for port in self._ports.values():
            port.cancel_queue.put_nowait(data)

    async def ready(self) -> bool:
        return any(p.started for p in self._ports.values())

    async def stats(self) -> dict[str, dict[str, Any]]:
        return {
            name: p.stats_source() if p.stats_source else {}
            for name, p in self._ports.items()
            if p.started
        }

    async def workers(self) -> dict[str, WorkerInfo]:
        return {n: p.info for n, p in self._ports.items() if p.started and p.info is not None}

    def worker(self, name: str | None = None) -> WorkerPort:
        port = _InProcessPort(self, name or f"worker-{uuid.uuid4().hex[:8]}")
        self._ports[port.name] = port
        return port


class _InProcessPort(WorkerPort):
    def __init__(self, bus: InProcessBus, name: str) -> None:
        self.name = name
        self._bus = bus
        self.cancel_queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.started = False
        self.stats_source: StatsSource | None = None
        self.info: WorkerInfo | None = None
        self._ids = 0

    async def start(
        self, stats_source: StatsSource | None = None, info: WorkerInfo | None = None
    ) -> None:
        self.stats_source = stats_source
        self.info = info
        self.started = True

    async def receive(self, max_count: int = 16, timeout: float = 1.0) -> list[Delivery]:
        q = self._bus._requests
        try:
            first = await asyncio.wait_for(q.get(), timeout)
        except TimeoutError:
            return []
        raw = [first]
        while len(raw) < max_count and not q.empty():
            raw.append(q.get_nowait())
        out = []
        for data in raw:
            msg = decode(data)
            assert isinstance(msg, GenerateRequest | AdminRequest)
            self._ids += 1
            out.append(Delivery(f"{self.name}-{self._ids}", msg))
        return out

    async def cancels(self, timeout: float = 1.0) -> list[Cancel]:
        try:
            first = await asyncio.wait_for(self.cancel_queue.get(), timeout)
        except TimeoutError:
            return []
        raw = [first]
        while not self.cancel_queue.empty():
            raw.append(self.cancel_queue.get_nowait())
        return [m for m in map(decode, raw) if isinstance(m, Cancel)]

    async def is_cancelled(self, request_id: str) -> bool:
        return request_id in self._bus._cancelled

    async def emit(self, event: TokenEvent) -> None:
        stream = self._bus._streams.get(event.request_id)
        if stream is not None:
            stream.queue.put_nowait(event)

    async def ack(self, delivery: Delivery) -> None:
        pass

    async def close(self) -> None:
        self.started = False
        self._bus._ports.pop(self.name, None)
