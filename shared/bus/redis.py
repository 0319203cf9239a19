"""RedisBus: the bus on Redis Streams (its key layout: redis_layout.py; a worker's end:
redis_port.RedisWorkerPort).

Requests go on the shared stream or on a worker's own (routed); token events on a per-request
stream that a gateway reads for all its requests in one blocking XREAD (woken through its
`{prefix}:wake:{id}` when it submits one); cancels on the broadcast stream that every worker
reads. The gateway owns a request's event stream (it deletes the key on close).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import msgpack
from kvserve.shared.bus.base import Bus, BusUnavailableError, EventStream, WorkerPort
from kvserve.shared.bus.redis_layout import (
    RedisBusConfig,
    RedisKeys,
    read_messages,
    registered_workers,
)
from kvserve.shared.bus.redis_port import RedisWorkerPort
from kvserve.shared.protocol import (
    Cancel,
    KVEvent,
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
        except BaseException:
            self.reader.discard(stream)
            raise
        return stream

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
        return {
            n: msgpack.unpackb(r, raw=False) if r else {} for n, r in zip(names, raw, strict=True)
        }

    async def workers(self) -> dict[str, WorkerInfo]:
        names = await self.live_workers()
        raw = await self.redis.hmget(self.keys.info_key, names) if names else []
        out: dict[str, WorkerInfo] = {}
        for name, data in zip(names, raw, strict=True):
            with contextlib.suppress(ProtocolError, TypeError):
                msg = decode(data)
                if isinstance(msg, WorkerInfo) and msg.name == name:
                    out[name] = msg
        return out

    async def kv_events(self, block_ms: int = 1000) -> list[KVEvent]:
        reply = await self.redis.xread(
            {self.keys.kv_events_key: self._kv_cursor}, count=4096, block=block_ms
        )
        events, self._kv_cursor = read_messages(reply, KVEvent, self._kv_cursor)
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
        return RedisWorkerPort(
            self.redis, self.keys, self.config, name or f"worker-{uuid.uuid4().hex[:8]}"
        )

    async def close(self) -> None:
        await self.reader.close()
        with contextlib.suppress(Exception):
            await self.redis.delete(self.reader.wake_key)
        await self.redis.aclose()
