"""The disaggregated topology in one process, for the prefill and decode worker tests (the
`disagg` fixture in conftest.py builds it).

Two engines (one per role, on the session's weights) whose store connectors share one in-memory
block store, as two processes share a Redis store; a prefill worker on one in-process bus, a
decode worker on another, and the prefill worker's `forward` putting its hand-off on the decode
bus. Each test gets fresh buses, workers and store, and engines whose prefix caches are empty.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.services.workers.decode import DecodeWorker
from kvserve.services.workers.prefill import PrefillWorker
from kvserve.shared.bus.base import Delivery, EventStream, WorkerPort
from kvserve.shared.bus.memory import InProcessBus
from kvserve.shared.protocol import Cancel, GenerateRequest, TokenEvent
from kvserve.shared.store.base import BlockStore
from kvserve.shared.store.hashing import BlockHash
from kvserve.shared.store.memory import MemoryStore

NUM_BLOCKS = 64


class SharedMemoryStore(BlockStore):
    """One MemoryStore for two engines' store connectors. Each connector calls its store from
    its own event-loop thread and MemoryStore is single-loop, so every call holds one lock
    (MemoryStore's coroutines never suspend, so the lock is never held across a wait).
    `close()` is a no-op: the test owns the store, not the engines.

    `gate`: while it is an unset Event, `contains` (the first call of an engine's store fetch)
    sets `at_gate` and waits for it, holding that engine's request in its fetch."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self._lock = threading.Lock()
        self.gate: threading.Event | None = None
        self.at_gate = threading.Event()

    async def get_many(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        with self._lock:
            return await self.inner.get_many(hashes)

    async def put_many(
        self, items: Sequence[tuple[BlockHash, bytes]], ttl_s: int | None = None
    ) -> int:
        with self._lock:
            return await self.inner.put_many(items)

    async def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        gate = self.gate
        if gate is not None:
            self.at_gate.set()
            gate.wait(60)
        with self._lock:
            return await self.inner.contains(hashes)

    async def delete(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            await self.inner.delete(hashes)

    async def pin(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            await self.inner.pin(hashes)

    async def unpin(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            await self.inner.unpin(hashes)

    def stats(self) -> dict[str, object]:
        with self._lock:
            return self.inner.stats()

    async def close(self) -> None:
        pass

    def hashes(self) -> set[bytes]:
        """Every block (and tail) it holds."""
        with self._lock:
            return set(self.inner._data)


class AckRecordingPort(WorkerPort):
    """A worker's in-process port that records each ack (the in-process bus's own ack does
    nothing), so a test can wait for a request's end and count its acks."""

    def __init__(self, port: WorkerPort) -> None:
        self.port = port
        self.name = port.name
        self.acks: list[str] = []
        self._acked = asyncio.Condition()

    async def start(self, stats_source: Any = None, info: Any = None) -> None:
        await self.port.start(stats_source, info)

    async def receive(self, max_count: int = 16, timeout: float = 1.0) -> list[Delivery]:
        return await self.port.receive(max_count, timeout)

    async def cancels(self, timeout: float = 1.0) -> list[Cancel]:
        return await self.port.cancels(timeout)

    async def is_cancelled(self, request_id: str) -> bool:
        return await self.port.is_cancelled(request_id)

    async def emit(self, event: TokenEvent) -> None:
        await self.port.emit(event)

    async def ack(self, delivery: Delivery) -> None:
        await self.port.ack(delivery)
        async with self._acked:
            self.acks.append(delivery.request.request_id)
            self._acked.notify_all()

    async def close(self) -> None:
        await self.port.close()

    async def acked(self, request_id: str, timeout: float = 60.0) -> None:
        """Wait until the request has been acked."""
        async with asyncio.timeout(timeout), self._acked:
            await self._acked.wait_for(lambda: request_id in self.acks)


@dataclass
class Disagg:
    """One test's topology. `handoffs`: the decode bus's event stream of each forwarded
    request (what a gateway reads in the Redis topology, where both roles share the request's
    event stream); `forwarded`: the requests as the prefill worker forwarded them;
    `before_forward`: an optional step run on each hand-off before it reaches the decode bus."""

    store: SharedMemoryStore
    prefill_bus: InProcessBus = field(default_factory=InProcessBus)
    decode_bus: InProcessBus = field(default_factory=InProcessBus)
    prefill_port: AckRecordingPort = field(init=False)
    decode_port: AckRecordingPort = field(init=False)
    prefill: PrefillWorker = field(init=False)
    decode: DecodeWorker = field(init=False)
    handoffs: dict[str, EventStream] = field(default_factory=dict)
    forwarded: list[GenerateRequest] = field(default_factory=list)
    before_forward: Callable[[GenerateRequest], Awaitable[None]] | None = None
    _forwarded: asyncio.Event = field(default_factory=asyncio.Event)

    async def forward(self, req: GenerateRequest) -> None:
        if self.before_forward is not None:
            await self.before_forward(req)
        self.handoffs[req.request_id] = await self.decode_bus.submit(req)
        self.forwarded.append(req)
        self._forwarded.set()

    async def handoff(self, request_id: str, timeout: float = 60.0) -> EventStream:
        """The decode stream of a request, once the prefill worker has forwarded it."""
        async with asyncio.timeout(timeout):
            while request_id not in self.handoffs:
                self._forwarded.clear()
                await self._forwarded.wait()
        return self.handoffs[request_id]
