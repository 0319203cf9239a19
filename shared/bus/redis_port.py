"""RedisWorkerPort: a worker's end of the Redis bus.

A request stays pending in its stream's consumer group until its worker acks it, so a worker
that dies leaves it pending and a live one claims it (XAUTOCLAIM after `claim_idle_s`; live
workers refresh the idle time of what they hold on every heartbeat, so only a dead worker's
messages go stale). A live worker also adopts the own stream of a worker whose heartbeat
stopped: it claims what that worker held, takes what it never read, and removes its
registration once the stream is empty. A group that disappeared (Redis restarted empty) is
created again on the next read. A request delivered more than `max_deliveries` times (a
backstop; workers quarantine by strikes, services/workers/engine_worker.py) is failed with an
error event instead of being run again. Registration, stats and info are refreshed on
every heartbeat (so a Redis that restarts empty learns them again). Whatever the port reads
(requests, cancels, a request's earlier events, its resync key) may be malformed: it is dropped
and counted in `drops` (shared/bus/drops.py); a dropped request is acked and deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import msgpack
from kvserve.shared.bus.base import Delivery, StatsSource, WorkerPort
from kvserve.shared.bus.drops import BusDrops
from kvserve.shared.bus.redis_layout import (
    RedisBusConfig,
    RedisKeys,
    read_messages,
    registered_workers,
    text,
)
from kvserve.shared.protocol import (
    AdminRequest,
    Cancel,
    ErrorInfo,
    GenerateRequest,
    KVEvent,
    TokenEvent,
    WorkerInfo,
    encode,
    error_event,
)
from kvserve.shared.tasks import cancel_and_wait

log = logging.getLogger("kvserve.shared.bus")


class RedisWorkerPort(WorkerPort):
    """A worker's end of the Redis bus (see the bus's module for what it guarantees)."""

    def __init__(
        self,
        redis: Any,
        keys: RedisKeys,
        config: RedisBusConfig,
        name: str,
        drops: BusDrops | None = None,
    ) -> None:
        self.name = name
        self.drops = drops or BusDrops(config.max_message_bytes)  # what its readers refused
        self._r: Any = redis
        self._keys = keys
        self._cfg = config
        self.own_key = keys.to_key(name)
        self._held: dict[str, Delivery] = {}  # received, not yet acked
        self._cancel_cursor: bytes | str | None = None
        self._stats_source: StatsSource | None = None
        self._info: WorkerInfo | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._last_claim = 0.0
        self._scripts = _Scripts(redis)
        self._token = f"{name}:{uuid.uuid4().hex}"  # this incarnation (probation holder)
        self.quarantined = 0  # requests failed instead of delivered again (max_deliveries)

    async def start(
        self, stats_source: StatsSource | None = None, info: WorkerInfo | None = None
    ) -> None:
        self._stats_source = stats_source
        self._info = info
        await self._create_groups((self._keys.request_key, self.own_key))
        await self._init_cancel_cursor()
        await self.heartbeat()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())

    async def _create_groups(self, keys: tuple[str, ...]) -> None:
        """The consumer group on each stream, reading from its first entry (so requests added
        before the group existed are delivered); one that exists already stays."""
        from redis.exceptions import ResponseError

        for key in keys:
            try:
                await self._r.xgroup_create(key, self._cfg.group, id="0", mkstream=True)
            except ResponseError as e:
                # BUSYGROUP: it exists already. Anything else (the bus full, refusing writes)
                # goes to the caller: a read that found no group must not retry at once.
                if "BUSYGROUP" not in str(e):
                    raise

    async def _init_cancel_cursor(self) -> None:
        """Read cancels from now on (older ones reach us through the cancelled keys)."""
        last = await self._r.xrevrange(self._keys.cancel_key, count=1)
        self._cancel_cursor = last[0][0] if last else "0-0"

    async def heartbeat(self) -> None:
        """Say we are alive, publish stats and info, and reset the idle time of every request
        we hold (so XAUTOCLAIM takes only a dead worker's requests)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.zadd(self._keys.workers_key, {self.name: time.time()})
        if self._stats_source is not None:
            report = {**self._stats_source(), "published_at": time.time()}
            stats = msgpack.packb(report, default=str)
            pipe.hset(self._keys.stats_key, self.name, stats)
        if self._info is not None:
            pipe.hset(self._keys.info_key, self.name, encode(self._info))
        await pipe.execute()
        await self._keep_held()

    async def _keep_held(self) -> None:
        """Reset the idle time of each delivery still ours; one that another worker claimed
        meanwhile (we were paused past claim_idle_s) is dropped and `on_taken_over` told."""
        by_stream: dict[str, list[str]] = {}
        for d in self._held.values():
            by_stream.setdefault(d.stream, []).append(d.message_id)
        for key, ids in by_stream.items():
            lost = await self._scripts.keep(keys=[key], args=[self._cfg.group, self.name, *ids])
            for mid in map(text, lost):
                gone = self._held.pop(mid, None)
                if gone is not None:
                    rid = gone.request.request_id
                    log.warning("request %s was taken over by another worker", rid)
                    if self.on_taken_over is not None:
                        self.on_taken_over(gone)

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
            (self._keys.request_key, self.own_key), max_count, max(1, int(timeout * 1000))
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
                d = await self._delivery(text(stream), entry_id, fields, redelivered=False)
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
        for key in (self._keys.request_key, self.own_key):
            out += await self._autoclaim(key, max_count - len(out))
        for name in await registered_workers(self._r, self._keys, self._cfg, alive=False):
            if len(out) >= max_count:
                break
            if name != self.name:
                out += await self._adopt(name, max_count - len(out))
        return out

    async def _adopt(self, name: str, max_count: int) -> list[Delivery]:
        """A dead worker's own stream: what it held (once idle long enough) and what it never
        read; its registration goes once the stream is empty."""
        key = self._keys.to_key(name)
        out = await self._autoclaim(key, max_count)
        if len(out) < max_count:
            out += await self._read_new((key,), max_count - len(out), None)
        if not out and not await self._r.xlen(key):
            pipe = self._r.pipeline(transaction=False)
            pipe.zrem(self._keys.workers_key, name)
            pipe.hdel(self._keys.info_key, name)
            pipe.hdel(self._keys.stats_key, name)
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
            epoch = await self._times_delivered(key, entry_id)
            if epoch > self._cfg.max_deliveries:
                await self._quarantine(key, entry_id, epoch)
                continue
            d = await self._delivery(key, entry_id, fields, redelivered=True, epoch=epoch)
            if d is not None:
                out.append(d)
        return out

    async def _times_delivered(self, key: str, entry_id: bytes) -> int:
        """How many times the entry was delivered, this claim included: its epoch."""
        info = await self._r.xpending_range(
            key, self._cfg.group, min=entry_id, max=entry_id, count=1
        )
        return int(info[0]["times_delivered"]) if info else 1

    async def _quarantine(self, key: str, entry_id: bytes, epoch: int) -> None:
        """The request's workers died with it max_deliveries times: fail it to its client
        (an error event of this epoch) instead of running it again."""
        d = await self._delivery(key, entry_id, (await self._fields(key, entry_id)) or {}, True)
        self.quarantined += 1
        if d is None:
            await self._ack_id(key, entry_id)
            return
        rid = d.request.request_id
        log.error("quarantining request %s: its workers died %d times", rid, epoch - 1)
        err = ErrorInfo(
            f"request quarantined: the workers that ran it died {epoch - 1} times; it is not "
            "run again",
            "server_error",
            None,
            "quarantined",
        )
        await self.emit(error_event(rid, 0, err, epoch))
        await self.ack(d)

    async def _fields(self, key: str, entry_id: bytes) -> dict[bytes, bytes] | None:
        rows = await self._r.xrange(key, min=entry_id, max=entry_id)
        return dict(rows[0][1]) if rows else None

    async def _delivery(
        self,
        key: str,
        entry_id: bytes | str,
        fields: dict[bytes, bytes],
        redelivered: bool,
        epoch: int = 1,
    ) -> Delivery | None:
        mid = text(entry_id)
        msg = self.drops.message("requests", fields, f"{key} {mid}")
        if msg is not None and not isinstance(msg, GenerateRequest | AdminRequest):
            self.drops.record("requests", "invalid", f"{key} {mid}", f"a {msg.KIND} message")
            msg = None
        if msg is None:  # never delivered again
            await self._ack_id(key, mid)
            return None
        d = Delivery(mid, msg, redelivered, key, epoch)
        self._held[mid] = d
        return d

    async def cancels(self, timeout: float = 1.0) -> list[Cancel]:
        if self._cancel_cursor is None:
            await self._init_cancel_cursor()
        reply = await self._r.xread(
            {self._keys.cancel_key: self._cancel_cursor},
            count=256,
            block=max(1, int(timeout * 1000)),
        )
        out, self._cancel_cursor = read_messages(
            reply, Cancel, self._cancel_cursor, self.drops, "cancel"
        )
        return out

    async def is_cancelled(self, request_id: str) -> bool:
        return bool(await self._r.exists(self._keys.cancelled_key(request_id)))

    async def emit(self, event: TokenEvent) -> None:
        key = self._keys.out_key(event.request_id)
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
                self._keys.kv_events_key,
                {b"m": encode(event)},
                maxlen=self._cfg.kv_events_maxlen,
                approximate=True,
            )
        await pipe.execute()

    async def strikes(self, request_id: str) -> int:
        keys = [self._keys.probation_key(request_id), self._keys.strikes_key(request_id)]
        ttl = self._cfg.out_ttl_s
        return int(await self._scripts.strike(keys=keys, args=[self._token, ttl]))

    async def begin_probation(self, request_id: str) -> None:
        key = self._keys.probation_key(request_id)
        await self._r.set(key, self._token, ex=self._cfg.out_ttl_s)

    async def end_probation(self, request_id: str) -> None:
        await self._r.delete(self._keys.probation_key(request_id))

    async def resync_requested(self) -> bool:
        from redis.exceptions import ResponseError

        key = self._keys.resync_key(self.name)
        try:
            return bool(await self._r.getdel(key))
        except ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise
        # Not a string (no router wrote it): removed, so that a router's next request counts.
        await self._r.delete(key)
        self.drops.record("resync", "invalid", key, "not a string key")
        return False

    async def emitted(self, request_id: str) -> list[TokenEvent]:
        key = self._keys.out_key(request_id)
        reply = [(key, await self._r.xrange(key))]
        events, _ = read_messages(reply, TokenEvent, None, self.drops, "events")
        for e in events:
            if e.request_id != request_id:
                self.drops.record("events", "invalid", key, f"an event of {e.request_id!r}")
        return [e for e in events if e.request_id == request_id]

    def dropped(self) -> dict[str, dict[str, int]]:
        return self.drops.snapshot()

    async def ack(self, delivery: Delivery) -> None:
        self._held.pop(delivery.message_id, None)
        await self._ack_id(delivery.stream or self._keys.request_key, delivery.message_id)

    async def _ack_id(self, key: str, message_id: bytes | str) -> None:
        """Ack and delete the entry, unless another worker holds it now (took it over)."""
        await self._scripts.ack(keys=[key], args=[self._cfg.group, self.name, message_id])

    async def close(self) -> None:
        """Score ourselves dead (not deregistered): what is left on our own stream goes to a
        live worker, which removes the registration once the stream is empty."""
        if self._heartbeat_task is not None:
            await cancel_and_wait(self._heartbeat_task)
        with contextlib.suppress(Exception):
            await self._r.zadd(self._keys.workers_key, {self.name: 0})


# Both run as one step in Redis, so a take-over cannot slip between the ownership check and
# the claim or the ack.
_KEEP_IF_OURS = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if type(p) == 'table' and p.err == nil then
    if p[1] ~= nil and p[1][2] == ARGV[2] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    else
      table.insert(lost, ARGV[i])
    end
  end
end
return lost
"""
_ACK_IF_OURS = """
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if type(p) == 'table' and p.err == nil and p[1] ~= nil and p[1][2] ~= ARGV[2] then
  return 0
end
redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return 1
"""


# A probation held by another incarnation (one that died, or was paused past the claim timeout,
# while running the request on probation) becomes a strike; returns the strikes.
_STRIKE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  redis.call('INCR', KEYS[2])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('DEL', KEYS[1])
end
return tonumber(redis.call('GET', KEYS[2]) or '0')
"""


class _Scripts:
    """The port's Lua scripts: `keep` (claim again each delivery still ours, return the ids
    that are not), `ack` (ack and delete an entry unless another consumer holds it) and
    `strike` (a dead holder's probation becomes a strike)."""

    def __init__(self, redis: Any) -> None:
        self.keep = redis.register_script(_KEEP_IF_OURS)
        self.ack = redis.register_script(_ACK_IF_OURS)
        self.strike = redis.register_script(_STRIKE)
