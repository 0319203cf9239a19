"""RedisBus: the bus on Redis Streams (its key layout: redis_layout.py; a worker's end:
redis_port.RedisWorkerPort).

Requests go on the shared stream or on a worker's own (routed); token events on a per-request
stream that a gateway reads for all its requests in one blocking XREAD (woken through its
`{prefix}:wake:{id}` when it submits one); cancels on the broadcast stream that every worker
reads. The gateway owns a request's event stream (it deletes the key on close). Whatever the
gateway reads (token events, KV events, the workers' info and stats) may be malformed: it is
dropped and counted in `drops` (shared/bus/drops.py), and the reader goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from typing import Any

import msgpack
from kvserve.shared.bus.base import (
    Bus,
    BusFullError,
    BusUnavailableError,
    EventStream,
    WorkerPort,
)
from kvserve.shared.bus.drops import BusDrops
from kvserve.shared.bus.redis_layout import (
    RedisBusConfig,
    RedisKeys,
    read_messages,
    registered_workers,
    text,
)
from kvserve.shared.bus.redis_port import RedisWorkerPort
from kvserve.shared.protocol import (
    Cancel,
    KVEvent,
    Message,
    ProtocolError,
    TokenEvent,
    Work,
    WorkerInfo,
    decode,
    encode,
)
from kvserve.shared.tasks import cancel_and_wait

log = logging.getLogger("kvserve.shared.bus")


class _RedisEventStream(EventStream):
    """Events arrive in `_inbox` from the bus's `_EventReader` (lists of events, or the error
    that stopped the reader)."""

    def __init__(self, bus: RedisBus, request: Work) -> None:
        super().__init__(request)
        self._bus = bus
        self.key = bus.keys.out_key(request.request_id)
        self.last_id: bytes | str = "0-0"
        self._inbox: asyncio.Queue[list[TokenEvent] | BaseException] = asyncio.Queue()

    def deliver(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Hand the request's events on; any other entry is dropped (and counted)."""
        drops = self._bus.drops
        events = []
        for entry_id, fields in entries:
            self.last_id = entry_id
            where = f"{self.key} {text(entry_id)}"
            msg = drops.message("events", fields or {}, where)
            if msg is None:
                continue
            why = self._foreign(msg)
            if why is not None:
                drops.record("events", "invalid", where, why)
                continue
            assert isinstance(msg, TokenEvent)
            events.append(msg)
        self._inbox.put_nowait(events)

    def _foreign(self, msg: Message) -> str | None:
        """Why `msg` is not an event of this request (None when it is one)."""
        if not isinstance(msg, TokenEvent):
            return f"a {msg.KIND} message"
        if msg.request_id != self.request.request_id:
            return f"an event of {msg.request_id!r}"
        if msg.index >= self.request.n:
            return f"completion index {msg.index} of {self.request.n}"
        return None

    def fail(self, error: BaseException) -> None:
        self._inbox.put_nowait(error)

    def _stale(self, event: TokenEvent) -> None:
        detail = f"epoch {event.epoch} after a fence of epoch {self._epoch}"
        self._bus.drops.record("events", "stale", f"{self.key} seq {event.seq}", detail)

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


def _is_oom(error: BaseException) -> bool:
    from redis.exceptions import OutOfMemoryError

    return isinstance(error, OutOfMemoryError)


class RedisBus(Bus):
    def __init__(
        self,
        url: str,
        config: RedisBusConfig | None = None,
        redis: Any = None,
        drops: BusDrops | None = None,
    ) -> None:
        """`drops`: where the bus and the worker ports it makes count what they refuse (a
        BusDrops of its own by default)."""
        import redis.asyncio as aioredis

        self.config = config or RedisBusConfig()
        self.drops = drops or BusDrops(self.config.max_message_bytes)
        self.redis: Any = redis or aioredis.Redis.from_url(
            url,
            socket_timeout=self.config.socket_timeout_s,
            max_connections=self.config.max_connections,
        )
        self.keys = RedisKeys(self.config)
        self.reader = _EventReader(self)
        self._kv_cursor: bytes | str = "0-0"
        self._kv_read = False  # whether the last kv_events call returned any event

    async def request_resync(self, worker: str) -> None:
        await self.redis.set(self.keys.resync_key(worker), b"1", ex=60)

    async def submit(self, request: Work, worker: str | None = None) -> EventStream:
        stream = _RedisEventStream(self, request)
        self.reader.add(stream)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(
            self.keys.to_key(worker) if worker else self.keys.request_key, {b"m": encode(request)}
        )
        pipe.xadd(self.reader.wake_key, {b"w": b""}, maxlen=1, approximate=False)
        pipe.expire(self.reader.wake_key, self.config.out_ttl_s)
        try:
            await pipe.execute()
        except BaseException as e:
            self.reader.discard(stream)
            if _is_oom(e):
                raise BusFullError(f"the bus refuses writes: {e}") from e
            raise
        return stream

    async def send(self, request: Work, worker: str | None = None) -> None:
        key = self.keys.to_key(worker) if worker else self.keys.request_key
        try:
            await self.redis.xadd(key, {b"m": encode(request)})
        except Exception as e:
            if _is_oom(e):
                raise BusFullError(f"the bus refuses writes: {e}") from e
            raise

    async def cancel(self, request_id: str, reason: str = "client") -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.cancelled_key(request_id), reason, ex=self.config.cancel_ttl_s)
        pipe.xadd(
            self.keys.cancel_key,
            {b"m": encode(Cancel(request_id, reason))},
            maxlen=self.config.cancel_stream_maxlen,
            approximate=True,
        )
        await pipe.execute()

    async def live_workers(self) -> list[str]:
        return await registered_workers(self.redis, self.keys, self.config, alive=True)

    async def dead_workers(self) -> list[str]:
        """Registered workers whose heartbeat stopped (or that closed)."""
        return await registered_workers(self.redis, self.keys, self.config, alive=False)

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
        raw = await self.redis.hmget(self.keys.stats_key, names)
        out: dict[str, dict[str, Any]] = {}
        for name, data in zip(names, raw, strict=True):
            where = f"{self.keys.stats_key} {name}"
            report = None
            if data:
                report = self.drops.check(
                    "worker_stats", data, where, _stats_report, repeat_key=where
                )
            out[name] = report or {}
        return out

    async def workers(self) -> dict[str, WorkerInfo]:
        names = await self.live_workers()
        raw = await self.redis.hmget(self.keys.info_key, names) if names else []
        out: dict[str, WorkerInfo] = {}
        for name, data in zip(names, raw, strict=True):
            if data is None:
                continue  # registered, not described yet
            where = f"{self.keys.info_key} {name}"
            parse = functools.partial(_worker_info, name=name)
            info = self.drops.check("worker_info", data, where, parse, repeat_key=where)
            if info is not None:
                out[name] = info
        return out

    async def kv_events(self, block_ms: int = 1000) -> list[KVEvent]:
        reply = await self.redis.xread(
            {self.keys.kv_events_key: self._kv_cursor}, count=4096, block=block_ms
        )
        events, self._kv_cursor = read_messages(
            reply, KVEvent, self._kv_cursor, self.drops, "kv_events"
        )
        self._kv_read = bool(events)
        return events

    def kv_event_age_s(self) -> float | None:
        """From the last entry's id, the Redis server's time in ms when it was added (the
        reader's and the server's clocks are one machine's, or synchronised ones)."""
        if not self._kv_read:
            return None
        cursor = self._kv_cursor
        ms = int((cursor.decode() if isinstance(cursor, bytes) else cursor).split("-")[0])
        return max(0.0, time.time() - ms / 1000)

    def worker(self, name: str | None = None) -> WorkerPort:
        """A worker port on this bus's client, counting what it refuses in `drops`."""
        name = name or f"worker-{uuid.uuid4().hex[:8]}"
        return RedisWorkerPort(self.redis, self.keys, self.config, name, self.drops)

    def dropped(self) -> dict[str, dict[str, int]]:
        return self.drops.snapshot()

    async def close(self) -> None:
        await self.reader.close()
        with contextlib.suppress(Exception):
            await self.redis.delete(self.reader.wake_key)
        await self.redis.aclose()


def _worker_info(data: Any, name: str) -> WorkerInfo:
    """The WorkerInfo `name` published; ProtocolError for anything else."""
    msg = decode(data)
    if not isinstance(msg, WorkerInfo) or msg.name != name:
        raise ProtocolError(f"not a WorkerInfo of {name!r}")
    return msg


def _stats_report(data: Any) -> dict[str, Any]:
    """A worker's published stats: a msgpack map of plain values (string keys; numbers,
    strings, booleans, None, and lists and maps of them); ProtocolError for anything else."""
    try:
        report = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"not a msgpack stats report: {e}", "not_msgpack") from e
    if not isinstance(report, dict) or not _plain(report):
        raise ProtocolError("a stats report is a map of numbers, strings, lists and maps")
    return report


def _plain(value: Any, depth: int = 0) -> bool:
    """Is `value` JSON-like (what /v1/cache/stats can show as it is), at most 8 levels deep?"""
    if isinstance(value, dict):
        return depth < 8 and all(
            isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items()
        )
    if isinstance(value, list):
        return depth < 8 and all(_plain(v, depth + 1) for v in value)
    return value is None or isinstance(value, bool | int | float | str)
