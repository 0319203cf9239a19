"""The bus between the gateway and the engine workers, behind one async interface.

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

Two implementations:
- `InProcessBus`: asyncio queues, for `kvserve serve` (gateway and worker on one event loop).
- `RedisBus`: Redis Streams. Requests go on `kvserve:prefill` (shared) or on a worker's own
  `kvserve:to:{name}` (routed), each read through a consumer group; a request stays pending
  until its worker acks it, so a worker that dies leaves it pending and a live one claims it
  (XAUTOCLAIM after `claim_idle_s`; live workers refresh the idle time of what they hold on every
  heartbeat, so only a dead worker's messages go stale). A live worker also adopts the own
  stream of a worker whose heartbeat stopped: it claims what that worker held, takes what it
  never read, and removes its registration once the stream is empty. A group that disappeared
  (Redis restarted empty) is created again on the next read. Token events go
  on `kvserve:out:{id}` (expiring), which a gateway reads for all its requests in one blocking
  XREAD (woken through its `kvserve:wake:{id}` when it submits one); cancels on the broadcast
  stream `kvserve:cancel` that every worker reads, plus a short-lived `kvserve:cancelled:{id}`
  key for requests not yet picked up. Workers register in the sorted set `kvserve:workers`
  (score: last heartbeat; a worker that closes scores itself dead), describe themselves in the
  hash `kvserve:worker_info` and publish their stats in `kvserve:worker_stats`, both refreshed
  on every heartbeat (so a Redis that restarts empty learns them again). KV events go on the
  bounded stream `kvserve:kv_events`.

Ownership: the gateway owns a request's event stream (it deletes the Redis key on close); a
worker owns a delivery from `receive()` until it acks it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
from kvserve.shared.protocol import (
    AdminRequest,
    Cancel,
    ErrorInfo,
    GenerateRequest,
    KVEvent,
    ProtocolError,
    TokenEvent,
    Work,
    WorkerInfo,
    decode,
    encode,
)
from kvserve.shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)

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


class EventStream(abc.ABC):
    """One request's token events for the gateway: duplicates (seq already seen) are dropped,
    events are released in seq order, iteration ends after the terminal event (an error, or
    every completion index finished). `close()` releases what the bus holds for it."""

    def __init__(self, request: Work) -> None:
        self.request = request
        self._next_seq = 0
        self._held: dict[int, TokenEvent] = {}  # arrived ahead of a gap
        self._finished: set[int] = set()
        self.done = False

    @abc.abstractmethod
    async def _receive(self) -> list[TokenEvent]:
        """Wait for the next raw events (possibly duplicates, possibly out of order)."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent]:
        while not self.done:
            error: TokenEvent | None = None
            for event in await self._receive():
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

    async def publish_kv_events(self, events: list[KVEvent]) -> None:  # noqa: B027
        """Tell routers which blocks entered or left this worker's tiers (no-op in process)."""

    async def resync_requested(self) -> bool:
        """Has a router asked for a snapshot of this worker's blocks since the last call?"""
        return False

    @abc.abstractmethod
    async def close(self) -> None:
        """Deregister. Unacked deliveries stay pending (Redis) for another worker."""


class BusUnavailableError(ConnectionError):
    """The bus itself (Redis) cannot be reached."""


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

    async def request_resync(self, worker: str) -> None:  # noqa: B027
        """Ask `worker` to publish a snapshot of its blocks (a router missed some events)."""

    @abc.abstractmethod
    def worker(self, name: str | None = None) -> WorkerPort: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


def error_event(request_id: str, seq: int, error: ErrorInfo) -> TokenEvent:
    return TokenEvent(request_id=request_id, seq=seq, error=error)


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


# ---- in-process ------------------------------------------------------------------------------


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
    """Queues on one event loop. Messages still go through `encode`/`decode`, so what the
    in-process bus accepts is exactly what the Redis bus would."""

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
            msg = decode(encode(event))
            assert isinstance(msg, TokenEvent)
            stream.queue.put_nowait(msg)

    async def ack(self, delivery: Delivery) -> None:
        pass

    async def close(self) -> None:
        self.started = False
        self._bus._ports.pop(self.name, None)


# ---- Redis Streams ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RedisBusConfig:
    prefix: str = "kvserve"
    request_stream: str = "prefill"  # full key: {prefix}:{request_stream}
    group: str = "prefill"
    claim_idle_s: float = 30.0  # a pending request idle this long belongs to a dead worker
    heartbeat_s: float = 2.0
    worker_ttl_s: float = 10.0  # a worker without a heartbeat for this long is not alive
    out_ttl_s: int = 600  # per-request event streams expire (a gateway that died never reads)
    cancel_ttl_s: int = 600
    max_deliveries: int = 3  # a request delivered this often is failed, not retried again
    cancel_stream_maxlen: int = 10_000
    kv_events_maxlen: int = 100_000  # a router that falls further behind resynchronises
    # redis-py 8 gives up on a reply after 5 s; a host whose cores are saturated by the engines
    # (or a Redis busy with large store writes) stalls longer than that without being down.
    socket_timeout_s: float = 30.0
    # Connections the client may open. The requests in flight at a gateway wait for their events
    # on one connection (`_EventReader`), but a burst of submits and cancels takes one each
    # while it runs, and redis-py raises "Too many connections" past the bound instead of
    # waiting (with its default of 100, a burst of 101 requests would get a 503).
    max_connections: int = 1024
    # How long the gateway's one XREAD waits before it is issued again (a new request wakes it
    # at once); below socket_timeout_s.
    read_block_ms: int = 1000


class _RedisEventStream(EventStream):
    """Events arrive in `_inbox` from the bus's `_EventReader` (lists of events, or the error
    that stopped the reader)."""

    def __init__(self, bus: RedisBus, request: Work) -> None:
        super().__init__(request)
        self._bus = bus
        self.key = bus.out_key(request.request_id)
        self.last_id: bytes | str = "0-0"
        self._inbox: asyncio.Queue[list[TokenEvent] | BaseException] = asyncio.Queue()

    def deliver(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        events = []
        for entry_id, fields in entries:
            self.last_id = entry_id
            try:
                msg = decode(fields[b"m"])
            except (ProtocolError, KeyError):
                log.warning("dropping a malformed event on %s", self.key)
                continue
            if isinstance(msg, TokenEvent) and msg.request_id == self.request.request_id:
                events.append(msg)
        self._inbox.put_nowait(events)

    def fail(self, error: BaseException) -> None:
        self._inbox.put_nowait(error)

    async def _receive(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        item = await self._inbox.get()
        while True:
            if isinstance(item, BaseException):
                raise item
            events += item
            if self._inbox.empty():
                return events
            item = self._inbox.get_nowait()

    async def close(self) -> None:
        self._bus.reader.discard(self)
        with contextlib.suppress(Exception):
            await self._bus.redis.delete(self.key)


class _EventReader:
    """One task reads the event streams of every request a gateway has in flight, in one
    blocking XREAD at a time over their keys and this reader's wake-up stream, and hands each
    stream its entries (as vLLM's and SGLang's frontends read every request's output from one
    socket). `submit` adds to the wake-up stream in the request's round trip, so a new request's
    key joins the read at once. A gateway thus holds one waiting connection, not one per request
    in flight. The task runs while any stream is open. A failed read is retried once (the
    pool's connection may predate a Redis restart); a second failure in a row fails every open
    stream (its gateway request fails, as on a failed read of its own) and ends the task."""

    def __init__(self, bus: RedisBus) -> None:
        self._bus = bus
        self.wake_key = f"{bus.config.prefix}:wake:{uuid.uuid4().hex[:12]}"
        self._wake_id: bytes | str = "0-0"
        self._open: dict[str, _RedisEventStream] = {}
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def add(self, stream: _RedisEventStream) -> None:
        if self._closed:
            raise BusUnavailableError("the bus is closed")
        self._open[stream.key] = stream
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    def discard(self, stream: _RedisEventStream) -> None:
        if self._open.get(stream.key) is stream:
            del self._open[stream.key]

    async def _run(self) -> None:
        failed = False
        while self._open and not self._closed:
            keys: dict[str, bytes | str] = {self.wake_key: self._wake_id}
            keys.update((key, s.last_id) for key, s in self._open.items())
            try:
                reply = await self._bus.redis.xread(
                    keys, count=64, block=self._bus.config.read_block_ms
                )
            except Exception as e:
                if not failed:  # once more, on a new connection (this one may predate a restart)
                    failed = True
                    continue
                for stream in self._open.values():  # Redis down: every waiting request fails
                    stream.fail(e)
                self._open.clear()
                return
            failed = False
            for name, entries in reply or []:
                key = name.decode() if isinstance(name, bytes) else name
                if key == self.wake_key:
                    self._wake_id = entries[-1][0]
                elif (target := self._open.get(key)) is not None:
                    target.deliver(entries)

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            await cancel_and_wait(self._task)  # a single cancel can be lost in redis-py
        for stream in self._open.values():  # nobody reads for them any more
            stream.fail(BusUnavailableError("the bus is closed"))
        self._open.clear()


class RedisBus(Bus):
    def __init__(self, url: str, config: RedisBusConfig | None = None, redis: Any = None) -> None:
        import redis.asyncio as aioredis

        self.config = config or RedisBusConfig()
        self.redis: Any = redis or aioredis.Redis.from_url(
            url,
            socket_timeout=self.config.socket_timeout_s,
            max_connections=self.config.max_connections,
        )
        p = self.config.prefix
        self.request_key = f"{p}:{self.config.request_stream}"
        self.cancel_key = f"{p}:cancel"
        self.workers_key = f"{p}:workers"
        self.stats_key = f"{p}:worker_stats"
        self.info_key = f"{p}:worker_info"
        self.kv_events_key = f"{p}:kv_events"
        self.reader = _EventReader(self)
        self._kv_cursor: bytes | str = "0-0"

    def out_key(self, request_id: str) -> str:
        return f"{self.config.prefix}:out:{request_id}"

    def cancelled_key(self, request_id: str) -> str:
        return f"{self.config.prefix}:cancelled:{request_id}"

    def resync_key(self, worker: str) -> str:
        return f"{self.config.prefix}:resync:{worker}"

    async def request_resync(self, worker: str) -> None:
        await self.redis.set(self.resync_key(worker), b"1", ex=60)

    def to_key(self, worker: str) -> str:
        """The worker's own request stream (requests routed to it)."""
        return f"{self.config.prefix}:to:{worker}"

    async def submit(self, request: Work, worker: str | None = None) -> EventStream:
        stream = _RedisEventStream(self, request)
        self.reader.add(stream)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(self.to_key(worker) if worker else self.request_key, {b"m": encode(request)})
        pipe.xadd(self.reader.wake_key, {b"w": b""}, maxlen=1, approximate=False)
        pipe.expire(self.reader.wake_key, self.config.out_ttl_s)
        try:
            await pipe.execute()
        except BaseException:
            self.reader.discard(stream)
            raise
        return stream

    async def cancel(self, request_id: str, reason: str = "client") -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.cancelled_key(request_id), reason, ex=self.config.cancel_ttl_s)
        pipe.xadd(
            self.cancel_key,
            {b"m": encode(Cancel(request_id, reason))},
            maxlen=self.config.cancel_stream_maxlen,
            approximate=True,
        )
        await pipe.execute()

    async def live_workers(self) -> list[str]:
        since = time.time() - self.config.worker_ttl_s
        names = await self.redis.zrangebyscore(self.workers_key, since, "+inf")
        return [_text(n) for n in names]

    async def dead_workers(self) -> list[str]:
        """Registered workers whose heartbeat stopped (or that closed)."""
        since = time.time() - self.config.worker_ttl_s
        return [_text(n) for n in await self.redis.zrangebyscore(self.workers_key, 0, since)]

    async def ready(self) -> bool:
        from redis.exceptions import RedisError

        try:
            return bool(await self.live_workers())
        except (RedisError, OSError) as e:
            raise BusUnavailableError(f"Redis is unreachable: {e}") from e

    async def stats(self) -> dict[str, dict[str, Any]]:
        names = await self.live_workers()
        if not names:
            return {}
        raw = await self.redis.hmget(self.stats_key, names)
        return {
            n: msgpack.unpackb(r, raw=False) if r else {} for n, r in zip(names, raw, strict=True)
        }

    async def workers(self) -> dict[str, WorkerInfo]:
        names = await self.live_workers()
        raw = await self.redis.hmget(self.info_key, names) if names else []
        out: dict[str, WorkerInfo] = {}
        for name, data in zip(names, raw, strict=True):
            with contextlib.suppress(ProtocolError, TypeError):
                msg = decode(data)
                if isinstance(msg, WorkerInfo) and msg.name == name:
                    out[name] = msg
        return out

    async def kv_events(self, block_ms: int = 1000) -> list[KVEvent]:
        reply = await self.redis.xread(
            {self.kv_events_key: self._kv_cursor}, count=4096, block=block_ms
        )
        events, self._kv_cursor = _read_messages(reply, KVEvent, self._kv_cursor)
        return events

    def worker(self, name: str | None = None) -> WorkerPort:
        return _RedisPort(self, name or f"worker-{uuid.uuid4().hex[:8]}")

    async def close(self) -> None:
        await self.reader.close()
        with contextlib.suppress(Exception):
            await self.redis.delete(self.reader.wake_key)
        await self.redis.aclose()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


M = TypeVar("M")


def _read_messages(reply: Any, kind: type[M], cursor: Any) -> tuple[list[M], Any]:
    """The messages of `kind` in an XREAD reply (malformed entries skipped) and the id of the
    last entry read (`cursor` when there was none)."""
    out: list[M] = []
    for _stream, entries in reply or []:
        for entry_id, fields in entries:
            cursor = entry_id
            with contextlib.suppress(ProtocolError, KeyError):
                msg = decode(fields[b"m"])
                if isinstance(msg, kind):
                    out.append(msg)
    return out, cursor


class _RedisPort(WorkerPort):
    def __init__(self, bus: RedisBus, name: str) -> None:
        self.name = name
        self._bus = bus
        self._r: Any = bus.redis
        self._cfg = bus.config
        self.own_key = bus.to_key(name)
        self._held: dict[str, Delivery] = {}  # received, not yet acked
        self._cancel_cursor: bytes | str | None = None
        self._stats_source: StatsSource | None = None
        self._info: WorkerInfo | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._last_claim = 0.0

    async def start(
        self, stats_source: StatsSource | None = None, info: WorkerInfo | None = None
    ) -> None:
        self._stats_source = stats_source
        self._info = info
        await self._create_groups((self._bus.request_key, self.own_key))
        await self._init_cancel_cursor()
        await self.heartbeat()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())

    async def _create_groups(self, keys: tuple[str, ...]) -> None:
        """The consumer group on each stream, reading from its first entry (so requests added
        before the group existed are delivered); one that exists already stays."""
        for key in keys:
            with contextlib.suppress(Exception):  # BUSYGROUP: it exists already
                await self._r.xgroup_create(key, self._cfg.group, id="0", mkstream=True)

    async def _init_cancel_cursor(self) -> None:
        """Read cancels from now on (older ones reach us through the cancelled keys)."""
        last = await self._r.xrevrange(self._bus.cancel_key, count=1)
        self._cancel_cursor = last[0][0] if last else "0-0"

    async def heartbeat(self) -> None:
        """Say we are alive, publish stats and info, and reset the idle time of every request
        we hold (so XAUTOCLAIM takes only a dead worker's requests)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.zadd(self._bus.workers_key, {self.name: time.time()})
        if self._stats_source is not None:
            report = {**self._stats_source(), "published_at": time.time()}
            stats = msgpack.packb(report, default=str)
            pipe.hset(self._bus.stats_key, self.name, stats)
        if self._info is not None:
            pipe.hset(self._bus.info_key, self.name, encode(self._info))
        by_stream: dict[str, list[str]] = {}
        for d in self._held.values():
            by_stream.setdefault(d.stream, []).append(d.message_id)
        for key, ids in by_stream.items():
            pipe.xclaim(
                key, self._cfg.group, self.name, min_idle_time=0, message_ids=ids, justid=True
            )
        await pipe.execute()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._cfg.heartbeat_s)
            try:
                await self.heartbeat()
            except Exception:
                log.exception("worker heartbeat failed")

    async def receive(self, max_count: int = 16, timeout: float = 1.0) -> list[Delivery]:
        out = await self._claim_stale(max_count)
        if out:
            return out
        return await self._read_new(
            (self._bus.request_key, self.own_key), max_count, max(1, int(timeout * 1000))
        )

    async def _read_new(
        self, keys: tuple[str, ...], max_count: int, block_ms: int | None
    ) -> list[Delivery]:
        """Entries of `keys` never delivered to anyone; a missing group (Redis restarted
        empty, or a stream created by a submit before its worker) is created again."""
        from redis.exceptions import ResponseError

        try:
            reply = await self._r.xreadgroup(
                self._cfg.group,
                self.name,
                dict.fromkeys(keys, ">"),
                count=max_count,
                block=block_ms,
            )
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self._create_groups(keys)
            return []
        out = []
        for stream, entries in reply or []:
            for entry_id, fields in entries:
                d = await self._delivery(_text(stream), entry_id, fields, redelivered=False)
                if d is not None:
                    out.append(d)
        return out

    async def _claim_stale(self, max_count: int) -> list[Delivery]:
        """Requests whose worker died: XAUTOCLAIM those idle longer than claim_idle_s (on the
        shared stream and our own, where a previous run of this worker may have left some),
        then the own streams of dead workers. Checked at most once per heartbeat period."""
        now = time.monotonic()
        if now - self._last_claim < self._cfg.heartbeat_s:
            return []
        self._last_claim = now
        out: list[Delivery] = []
        for key in (self._bus.request_key, self.own_key):
            out += await self._autoclaim(key, max_count - len(out))
        for name in await self._bus.dead_workers():
            if len(out) >= max_count:
                break
            if name != self.name:
                out += await self._adopt(name, max_count - len(out))
        return out

    async def _adopt(self, name: str, max_count: int) -> list[Delivery]:
        """A dead worker's own stream: what it held (once idle long enough) and what it never
        read; its registration goes once the stream is empty."""
        key = self._bus.to_key(name)
        out = await self._autoclaim(key, max_count)
        if len(out) < max_count:
            out += await self._read_new((key,), max_count - len(out), None)
        if not out and not await self._r.xlen(key):
            pipe = self._r.pipeline(transaction=False)
            pipe.zrem(self._bus.workers_key, name)
            pipe.hdel(self._bus.info_key, name)
            pipe.hdel(self._bus.stats_key, name)
            pipe.delete(key)
            await pipe.execute()
        elif out:
            log.warning("adopted %d request(s) of dead worker %s", len(out), name)
        return out

    async def _autoclaim(self, key: str, max_count: int) -> list[Delivery]:
        from redis.exceptions import ResponseError

        if max_count <= 0:
            return []
        try:
            reply = await self._r.xautoclaim(
                key,
                self._cfg.group,
                self.name,
                min_idle_time=int(self._cfg.claim_idle_s * 1000),
                start_id="0-0",
                count=max_count,
            )
        except ResponseError:  # NOGROUP: nothing was ever delivered from it
            return []
        out = []
        for entry_id, fields in reply[1]:
            if fields is None:  # deleted while pending
                continue
            if await self._delivered_too_often(key, entry_id):
                continue
            d = await self._delivery(key, entry_id, fields, redelivered=True)
            if d is not None:
                out.append(d)
        return out

    async def _delivered_too_often(self, key: str, entry_id: bytes) -> bool:
        info = await self._r.xpending_range(
            key, self._cfg.group, min=entry_id, max=entry_id, count=1
        )
        if not info or info[0]["times_delivered"] <= self._cfg.max_deliveries:
            return False
        d = await self._delivery(key, entry_id, (await self._fields(key, entry_id)) or {}, True)
        if d is not None:
            err = ErrorInfo(
                f"request failed on {self._cfg.max_deliveries} workers; not retried again",
                "server_error",
            )
            await self.emit(error_event(d.request.request_id, 0, err))
            await self.ack(d)
        else:
            await self._ack_id(key, entry_id)
        return True

    async def _fields(self, key: str, entry_id: bytes) -> dict[bytes, bytes] | None:
        rows = await self._r.xrange(key, min=entry_id, max=entry_id)
        return dict(rows[0][1]) if rows else None

    async def _delivery(
        self, key: str, entry_id: bytes | str, fields: dict[bytes, bytes], redelivered: bool
    ) -> Delivery | None:
        mid = _text(entry_id)
        try:
            msg = decode(fields[b"m"])
            if not isinstance(msg, GenerateRequest | AdminRequest):
                raise ProtocolError(f"expected a generate request, got {type(msg).__name__}")
        except (ProtocolError, KeyError) as e:
            log.warning("dropping malformed request %s: %s", mid, e)
            await self._ack_id(key, mid)
            return None
        d = Delivery(mid, msg, redelivered, key)
        self._held[mid] = d
        return d

    async def cancels(self, timeout: float = 1.0) -> list[Cancel]:
        if self._cancel_cursor is None:
            await self._init_cancel_cursor()
        reply = await self._r.xread(
            {self._bus.cancel_key: self._cancel_cursor},
            count=256,
            block=max(1, int(timeout * 1000)),
        )
        out, self._cancel_cursor = _read_messages(reply, Cancel, self._cancel_cursor)
        return out

    async def is_cancelled(self, request_id: str) -> bool:
        return bool(await self._r.exists(self._bus.cancelled_key(request_id)))

    async def emit(self, event: TokenEvent) -> None:
        key = self._bus.out_key(event.request_id)
        pipe = self._r.pipeline(transaction=False)
        pipe.xadd(key, {b"m": encode(event)})
        pipe.expire(key, self._cfg.out_ttl_s)
        await pipe.execute()

    async def publish_kv_events(self, events: list[KVEvent]) -> None:
        if not events:
            return
        pipe = self._r.pipeline(transaction=False)
        for event in events:
            pipe.xadd(
                self._bus.kv_events_key,
                {b"m": encode(event)},
                maxlen=self._cfg.kv_events_maxlen,
                approximate=True,
            )
        await pipe.execute()

    async def resync_requested(self) -> bool:
        return bool(await self._r.getdel(self._bus.resync_key(self.name)))

    async def emitted(self, request_id: str) -> list[TokenEvent]:
        key = self._bus.out_key(request_id)
        events, _ = _read_messages([(key, await self._r.xrange(key))], TokenEvent, None)
        return [e for e in events if e.request_id == request_id]

    async def ack(self, delivery: Delivery) -> None:
        self._held.pop(delivery.message_id, None)
        await self._ack_id(delivery.stream or self._bus.request_key, delivery.message_id)

    async def _ack_id(self, key: str, message_id: bytes | str) -> None:
        pipe = self._r.pipeline(transaction=False)
        pipe.xack(key, self._cfg.group, message_id)
        pipe.xdel(key, message_id)
        await pipe.execute()

    async def close(self) -> None:
        """Score ourselves dead (not deregistered): what is left on our own stream goes to a
        live worker, which removes the registration once the stream is empty."""
        if self._heartbeat_task is not None:
            await cancel_and_wait(self._heartbeat_task)
        with contextlib.suppress(Exception):
            await self._r.zadd(self._bus.workers_key, {self.name: 0})
