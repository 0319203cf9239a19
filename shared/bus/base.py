"""The bus between the gateway and the engine workers: the one async interface both
implementations (`memory.InProcessBus`, `redis.RedisBus`) keep.

Gateway side (`Bus`): `submit(request, worker=None) -> EventStream` (the request's token events,
deduplicated by seq and released in seq order, ending after the request's terminal event; with
`worker`, the request goes to that worker's own stream, else to the shared one), `cancel(id)`,
`ready()` (is any worker alive), `stats()` (each live worker's latest engine statistics),
`workers()` (each live worker's WorkerInfo), `kv_events()` (the workers' KV events, for the
router).

Worker side (`WorkerPort`, one per worker, from `bus.worker(name)`): `start(stats, info)`,
`receive()` requests, `cancels()`, `is_cancelled(id)`, `emit(event)`, `emitted(id)` (what was
emitted for a request so far: a worker that takes one over goes on from there), `ack(delivery)`
once a request is done, `publish_kv_events(events)`.

Ownership: the gateway owns a request's event stream (it releases what the bus holds for it on
close); a worker owns a delivery from `receive()` until it acks it.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvserve.shared.protocol import Cancel, KVEvent, TokenEvent, Work, WorkerInfo

StatsSource = Callable[[], dict[str, Any]]


@dataclass(frozen=True)
class Delivery:
    """A request handed to a worker. `message_id` identifies it on the bus (for ack);
    `redelivered` is True when it was claimed from a worker that stopped answering. `request`
    is a generate request or an admin job (warm-up, flush)."""

    message_id: str
    request: Work
    redelivered: bool = False
    stream: str = ""  # the Redis stream it came from ("" in process)
    epoch: int = 1  # which delivery of the request this is (its events carry it)


class EventStream(abc.ABC):
    """One request's token events for the gateway: duplicates (seq already seen) are dropped,
    events are released in seq order, iteration ends after the terminal event (an error, or
    every completion index finished). Events arrive in the order they were written; one whose
    epoch is below the highest seen so far (a take-over's fence raised it) is dropped.
    `close()` releases what the bus holds for it."""

    def __init__(self, request: Work) -> None:
        self.request = request
        self._next_seq = 0
        self._held: dict[int, TokenEvent] = {}  # arrived ahead of a gap
        self._finished: set[int] = set()
        self._epoch = 0  # the highest delivery epoch seen: older ones' events are stale
        self.done = False

    @abc.abstractmethod
    async def _receive(self) -> list[TokenEvent]:
        """Wait for the next raw events (possibly duplicates, possibly out of order)."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    def _stale(self, event: TokenEvent) -> None:  # noqa: B027 - optional hook
        """An event of an epoch below the highest seen was dropped (counted where the bus
        counts its drops)."""

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent]:
        while not self.done:
            error: TokenEvent | None = None
            for event in await self._receive():
                if event.epoch < self._epoch:
                    self._stale(event)  # from a holder that was taken over since
                    continue
                self._epoch = event.epoch
                if event.error is not None:
                    error = error or event
                elif event.seq >= self._next_seq:
                    self._held.setdefault(event.seq, event)
            while not self.done and self._next_seq in self._held:
                event = self._held.pop(self._next_seq)
                self._next_seq += 1
                self._observe(event)
                yield event
            if error is not None and not self.done:
                # Terminal whatever its seq: a worker failing a request it never ran (a poison
                # message) does not know how many events came before.
                self.done = True
                yield error

    def _observe(self, event: TokenEvent) -> None:
        if event.finish_reason is not None:
            self._finished.add(event.index)
        if len(self._finished) >= self.request.n:
            self.done = True

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class WorkerPort(abc.ABC):
    """A worker's end of the bus."""

    name: str
    quarantined = 0  # requests failed instead of delivered again (their workers kept dying)
    # Called with a delivery that another worker has taken over from this one (it was paused,
    # not dead, past the claim timeout): the worker stops that request.
    on_taken_over: Callable[[Delivery], None] | None = None

    @abc.abstractmethod
    async def start(
        self, stats_source: StatsSource | None = None, info: WorkerInfo | None = None
    ) -> None:
        """Register as a live worker; `stats_source()` is published as this worker's stats,
        `info` as its description (for routers)."""

    @abc.abstractmethod
    async def receive(self, max_count: int = 16, timeout: float = 1.0) -> list[Delivery]:
        """Up to `max_count` requests (new ones, or ones claimed from a dead worker); waits at
        most `timeout` seconds for the first."""

    @abc.abstractmethod
    async def cancels(self, timeout: float = 1.0) -> list[Cancel]:
        """Cancels published since the previous call (every worker sees every cancel)."""

    @abc.abstractmethod
    async def is_cancelled(self, request_id: str) -> bool: ...

    @abc.abstractmethod
    async def emit(self, event: TokenEvent) -> None: ...

    @abc.abstractmethod
    async def ack(self, delivery: Delivery) -> None:
        """The request is done (finished, failed or cancelled): it is not redelivered."""

    async def emitted(self, request_id: str) -> list[TokenEvent]:
        """The token events already emitted for a request, in emission order (a worker taking
        over a request reads them to go on from there); none in process, where a request
        never changes worker."""
        return []

    async def strikes(self, request_id: str) -> int:
        """The request's strikes: workers that died while running it on probation, this
        call's finding included (a probation held by another incarnation that is gone counts
        one). 0 in process, where a request never changes worker."""
        return 0

    async def begin_probation(self, request_id: str) -> None:  # noqa: B027
        """Record that this worker runs the taken-over request on probation."""

    async def end_probation(self, request_id: str) -> None:  # noqa: B027
        """Its probation passed (its first output) or ended."""

    async def publish_kv_events(self, events: list[KVEvent]) -> None:  # noqa: B027
        """Tell routers which blocks entered or left this worker's tiers (no-op in process)."""

    async def resync_requested(self) -> bool:
        """Has a router asked for a snapshot of this worker's blocks since the last call?"""
        return False

    def dropped(self) -> dict[str, dict[str, int]]:
        """The bus entries this port's readers refused, {stream kind: {reason: count}}
        (shared/bus/drops.py); none in process, where nothing is decoded."""
        return {}

    @abc.abstractmethod
    async def close(self) -> None:
        """Deregister. Unacked deliveries stay pending (Redis) for another worker."""


class BusUnavailableError(ConnectionError):
    """The bus itself (Redis) cannot be reached."""


class BusFullError(BusUnavailableError):
    """The bus refuses writes: its Redis is at its memory bound (`noeviction`)."""


def is_bus_error(error: BaseException) -> bool:
    """Did a bus call fail for want of the bus (a connection lost, refused or timed out)?"""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return isinstance(error, OSError | RedisConnectionError | RedisTimeoutError)


class Bus(abc.ABC):
    """The gateway's end of the bus, and the factory of worker ports."""

    @abc.abstractmethod
    async def submit(self, request: Work, worker: str | None = None) -> EventStream:
        """Queue a request (or an admin job) for any worker, or for `worker`; its events are
        readable from the returned stream at once."""

    @abc.abstractmethod
    async def send(self, request: Work, worker: str | None = None) -> None:
        """Queue a request as `submit` does, without reading its events (a prefill worker
        forwarding its hand-off: the gateway reads them)."""

    @abc.abstractmethod
    async def cancel(self, request_id: str, reason: str = "client") -> None: ...

    @abc.abstractmethod
    async def ready(self) -> bool:
        """Is at least one worker alive? Raises BusUnavailableError when the bus itself cannot
        be reached (then nobody can tell)."""

    @abc.abstractmethod
    async def stats(self) -> dict[str, dict[str, Any]]:
        """Latest stats of each live worker, by worker name."""

    async def workers(self) -> dict[str, WorkerInfo]:
        """Each live worker that described itself, by name."""
        return {}

    async def kv_events(self, block_ms: int = 1000) -> list[KVEvent]:
        """The workers' KV events since the previous call (from the oldest retained on the
        first), waiting at most `block_ms` for one."""
        await asyncio.sleep(block_ms / 1000)
        return []

    def kv_event_age_s(self) -> float | None:
        """How long ago the newest event the last `kv_events` call returned was published
        (how far a reader is behind); None when the bus cannot tell or none was read."""
        return None

    async def request_resync(self, worker: str) -> None:  # noqa: B027
        """Ask `worker` to publish a snapshot of its blocks (a router missed some events)."""

    def dropped(self) -> dict[str, dict[str, int]]:
        """The bus entries the gateway's readers refused, {stream kind: {reason: count}}
        (shared/bus/drops.py); none in process, where nothing is decoded."""
        return {}

    @abc.abstractmethod
    def worker(self, name: str | None = None) -> WorkerPort: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass
