"""RedisStore: blocks in one Redis server, behind a per-call timeout, retries and a circuit breaker.

Keys: ``{namespace}:blk:{hex}`` (namespace ``kvserve:v1`` by default) hold the encoded block;
``{namespace}:pinned`` is a set of the hex hashes that are pinned. Unpinned blocks are written
with ``EX ttl``; pinned blocks carry no TTL (``pin`` PERSISTs them, ``unpin`` restores the TTL).
Redis owns memory eviction (run it with ``maxmemory`` + ``allkeys-lru``); this client never evicts.

Failure policy (the engine must never fail a request because of the store). It is applied per
*shard*: one server here, one master per shard in ``RedisClusterStore`` (redis_cluster.py), which
reuses all of it and only says how keys are routed and how a pipeline to a shard is made.

- Every call to a shard runs under one deadline of ``timeout_s`` (asyncio.wait_for) that covers up
  to ``attempts`` tries with exponential backoff from ``backoff_s``; redis-py's own retries are off.
  ``put_many`` makes two calls (read the pinned flags, then write), each under its own deadline;
  when the first fails, the second is not tried on that shard.
- A transport failure (connection refused/reset, timeout) counts as ``get_errors`` / ``put_errors``
  and as a failure of that shard's breaker; reads answer misses, writes are skipped. Nothing is
  raised.
- Redis refusing writes (``OOM`` under ``maxmemory`` + ``noeviction``, ``READONLY`` replica) skips
  those writes, counted in ``skipped_writes`` / ``refused_writes``; the server is reachable, so this
  is not a breaker failure. Other server error replies (per command, or for a whole call) count as
  errors and ``other_errors`` but not as breaker failures; a read that got one is a miss.
- While a shard's breaker is open every call to it is short-circuited (``short_circuits``): misses,
  skipped writes; ``presence`` names the hashes it did not ask about (``Presence.short_circuited``).
  After the cooldown one caller runs a probe on that shard (SET then GET of a fresh probe key that
  must round-trip) and only its success closes the breaker.

``bytes_stored`` is the bytes this client has written (Redis may since have evicted or expired
them); the server's own usage is in ``INFO memory``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from kvserve.shared.store.base import KEY_NAMESPACE, BlockStore, Presence, StoreStats, block_key
from kvserve.shared.store.base import pinned_set_key as _pinned_set_key
from kvserve.shared.store.breaker import CircuitBreaker
from kvserve.shared.store.hashing import BlockHash
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")

# OSError covers builtin TimeoutError (what asyncio.wait_for raises) and socket errors.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
)
STORE_ERRORS: tuple[type[BaseException], ...] = (RedisError, *TRANSPORT_ERRORS)

# The query parameters the store reads itself; the rest go to redis-py.
STORE_QUERY_KEYS = frozenset(
    {"ttl", "timeout", "attempts", "backoff", "failures", "cooldown", "namespace", "batch"}
)


def is_refused_write(exc: BaseException) -> bool:
    """Redis answered but will not take writes: OOM (maxmemory + noeviction) or READONLY."""
    if isinstance(exc, OutOfMemoryError | ReadOnlyError):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(("OOM", "READONLY"))


def split_store_query(url: str) -> tuple[dict[str, Any], dict[str, str], str]:
    """Split a store URL into (constructor keywords, breaker settings, URL for redis-py).

    Constructor keywords come from ``ttl timeout attempts backoff namespace batch``; breaker
    settings are ``failures`` and ``cooldown``; every other query parameter stays in the URL."""
    parts = urlsplit(url)
    q = parse_qsl(parts.query)
    mine = {k: v for k, v in q if k in STORE_QUERY_KEYS}
    rest = [(k, v) for k, v in q if k not in STORE_QUERY_KEYS]
    clean = urlunsplit(parts._replace(query=urlencode(rest)))
    kw: dict[str, Any] = {}
    if "ttl" in mine:
        kw["ttl_s"] = int(mine["ttl"])
    if "timeout" in mine:
        kw["timeout_s"] = float(mine["timeout"])
    if "attempts" in mine:
        kw["attempts"] = int(mine["attempts"])
    if "backoff" in mine:
        kw["backoff_s"] = float(mine["backoff"])
    if "namespace" in mine:
        kw["namespace"] = mine["namespace"]
    if "batch" in mine:
        kw["batch_size"] = int(mine["batch"])
    breaker: dict[str, str] = {k: mine[k] for k in ("failures", "cooldown") if k in mine}
    return kw, breaker, clean


def breaker_from_settings(settings: dict[str, str]) -> CircuitBreaker:
    return CircuitBreaker(
        failure_threshold=int(settings.get("failures", 5)),
        cooldown_s=float(settings.get("cooldown", 5.0)),
    )


@dataclasses.dataclass(frozen=True)
class Unserved:
    """A call to a shard that produced no replies: short-circuited by an open breaker (``error``
    None, nothing was sent) or failed as a whole (``error``: transport, deadline, error reply)."""

    error: BaseException | None


class RedisStore(BlockStore):
    backend: ClassVar[str] = "redis"
    # What a call to a shard may raise that the store swallows, and which of those are transport
    # failures (breaker failures). RedisClusterStore adds the cluster client's own errors.
    transport_errors: ClassVar[tuple[type[BaseException], ...]] = TRANSPORT_ERRORS
    store_errors: ClassVar[tuple[type[BaseException], ...]] = STORE_ERRORS
    SERVER: ClassVar[str] = "server"  # the one shard of a single-server store

    def __init__(
        self,
        client: Any,
        *,
        ttl_s: int | None = 86400,
        timeout_s: float = 0.5,
        attempts: int = 2,
        backoff_s: float = 0.01,
        breaker: CircuitBreaker | None = None,
        namespace: str = KEY_NAMESPACE,
        batch_size: int = 256,
    ) -> None:
        """``client`` (a ``redis.asyncio.Redis``) is owned by the store from now on (``close``
        closes it)."""
        self._client = client
        self.ttl_s = ttl_s or None
        self.timeout_s = timeout_s
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.breaker = breaker or CircuitBreaker()
        self.namespace = namespace
        self.batch_size = batch_size
        self._stats = StoreStats()
        self.short_circuits = 0
        self.refused_writes = 0
        self.other_errors = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        breaker: CircuitBreaker | None = None,
        **overrides: Any,
    ) -> RedisStore:
        """``redis://host:port/db?ttl=&timeout=&attempts=&backoff=&failures=&cooldown=
        &namespace=&batch=``; remaining query parameters go to redis-py. ``overrides`` are
        constructor keywords and win over the URL."""
        kw, breaker_settings, clean = split_store_query(url)
        kw.update(overrides)
        timeout = float(kw.get("timeout_s", 0.5))
        pool = aioredis.ConnectionPool.from_url(
            clean,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )
        client = aioredis.Redis(connection_pool=pool)
        return cls(client, breaker=breaker or breaker_from_settings(breaker_settings), **kw)

    # -- keys ------------------------------------------------------------------------------------

    def key(self, h: bytes) -> str:
        return block_key(BlockHash(h), self.namespace)

    @property
    def pinned_set_key(self) -> str:
        return _pinned_set_key(self.namespace)

    def _chunks(self, seq: Sequence[T]) -> list[Sequence[T]]:
        n = self.batch_size
        return [seq[i : i + n] for i in range(0, len(seq), n)]

    # -- shards: what RedisClusterStore overrides ------------------------------------------------

    def _route(self, keys: Sequence[str]) -> dict[str, list[int]]:
        """Positions of ``keys`` grouped by the shard that holds them."""
        return {self.SERVER: list(range(len(keys)))}

    def _pinned_shard(self) -> str:
        """The shard holding the pinned set."""
        return self.SERVER

    def _breaker_for(self, shard: str) -> CircuitBreaker:
        return self.breaker

    def _pipeline(self, shard: str) -> Any:
        """A non-transactional pipeline whose commands reach ``shard``."""
        return self._client.pipeline(transaction=False)

    def _queue_reads(self, pipe: Any, keys: Sequence[str]) -> None:
        for chunk in self._chunks(keys):
            pipe.mget(chunk)

    def _read_values(self, replies: list[Any], keys: Sequence[str]) -> list[Any]:
        """One value (bytes, None or an exception) per key from ``_queue_reads``' replies."""
        out: list[Any] = []
        for chunk, reply in zip(self._chunks(keys), replies, strict=True):
            out.extend([reply] * len(chunk) if isinstance(reply, BaseException) else reply)
        return out

    async def _probe_key(self, shard: str) -> str | None:
        """A fresh key that lands on ``shard``; None when the shard holds no keys now."""
        return f"{self.namespace}:probe:{uuid.uuid4().hex}"

    async def _drop_idle_connections(self, shard: str) -> None:
        """Connections in the pool may predate the outage; the probe starts on fresh ones."""
        await self._client.connection_pool.disconnect(inuse_connections=False)

    # -- failure handling ------------------------------------------------------------------------

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` with retries on transport errors, all under one ``timeout_s`` deadline."""

        async def tries() -> T:
            delay = self.backoff_s
            for i in range(self.attempts):
                try:
                    return await fn()
                except self.transport_errors:
                    if i == self.attempts - 1:
                        raise
                    await asyncio.sleep(delay)
                    delay *= 2
            raise AssertionError("unreachable")

        return await asyncio.wait_for(tries(), self.timeout_s)

    async def _available(self, shard: str) -> bool:
        """True when a call may go to ``shard`` now; runs its probe when the cooldown is over."""
        breaker = self._breaker_for(shard)
        if breaker.closed:
            return True
        if breaker.begin_probe():
            ok = False
            try:
                ok = await self._probe(shard)
            finally:  # also when the caller is cancelled: never leave the breaker half-open
                if ok:
                    breaker.probe_succeeded()
                else:
                    breaker.probe_failed()
            if ok:
                return True
        self.short_circuits += 1
        return False

    async def _probe(self, shard: str) -> bool:
        """SET a fresh probe key on ``shard``, GET it back, compare; True only on an exact round
        trip."""
        token = os.urandom(16)

        async def round_trip() -> bool:
            key = await self._probe_key(shard)
            if key is None:
                return False
            pipe = self._pipeline(shard)
            pipe.set(key, token, px=max(1000, int(self.timeout_s * 10_000)))
            pipe.get(key)
            pipe.delete(key)
            replies = await pipe.execute()
            return bool(replies[1] == token)

        try:
            await self._drop_idle_connections(shard)
            return await self._call(round_trip)
        except self.store_errors:
            return False

    def _failed(self, exc: BaseException, shard: str) -> None:
        """Account a failed call: transport errors feed the breaker, server replies do not."""
        if isinstance(exc, self.transport_errors):
            self._breaker_for(shard).record_failure()
        else:
            self.other_errors += 1

    async def _run(self, shard: str, build: Callable[[Any], None]) -> list[Any] | Unserved:
        """One pipelined call to ``shard`` under the failure policy: its replies (an exception in
        place of each command the server refused), or ``Unserved``. Never raises for an
        unavailable store."""
        if not await self._available(shard):
            return Unserved(None)

        async def once() -> list[Any]:
            pipe = self._pipeline(shard)
            build(pipe)
            replies = list(await pipe.execute(raise_on_error=False))
            # A connection lost mid-pipeline can surface as per-command errors: the call failed.
            lost = next((r for r in replies if isinstance(r, self.transport_errors)), None)
            if lost is not None:
                raise lost
            return replies

        try:
            replies = await self._call(once)
        except self.store_errors as e:
            self._failed(e, shard)
            return Unserved(e)
        self._breaker_for(shard).record_success()
        return replies

    def _count_unserved_writes(self, unserved: Unserved, n: int) -> None:
        if unserved.error is None:
            self._stats.skipped_writes += n
        elif is_refused_write(unserved.error):
            self.refused_writes += n
            self._stats.skipped_writes += n
        else:
            self._stats.put_errors += n

    def _count_reply_errors(self, replies: Sequence[Any]) -> None:
        """Account the commands of a write call that the server refused."""
        for r in replies:
            if isinstance(r, BaseException):
                if is_refused_write(r):
                    self.refused_writes += 1
                    self._stats.skipped_writes += 1
                else:
                    self.other_errors += 1
                    self._stats.put_errors += 1

    # -- BlockStore ------------------------------------------------------------------------------

    async def get_many(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        if not hashes:
            return []
        keys = [self.key(h) for h in hashes]
        result: list[bytes | None] = [None] * len(keys)

        async def read(shard: str, idx: list[int]) -> None:
            mine = [keys[i] for i in idx]
            replies = await self._run(shard, lambda pipe: self._queue_reads(pipe, mine))
            if isinstance(replies, Unserved):
                self._stats.get_errors += int(replies.error is not None)
                self._stats.misses += len(idx)
                return
            for i, v in zip(idx, self._read_values(replies, mine), strict=True):
                if isinstance(v, BaseException):
                    self.other_errors += 1
                    self._stats.get_errors += 1
                elif v is not None:
                    result[i] = bytes(v)
            hits = sum(result[i] is not None for i in idx)
            self._stats.hits += hits
            self._stats.misses += len(idx) - hits

        await asyncio.gather(*(read(s, idx) for s, idx in self._route(keys).items()))
        return result

    async def _pinned_flags(self, hexes: Sequence[str]) -> list[bool] | Unserved:
        """Whether each hex is in the pinned set (False where the server refused the lookup)."""

        def build(pipe: Any) -> None:
            for chunk in self._chunks(hexes):
                pipe.smismember(self.pinned_set_key, list(chunk))

        replies = await self._run(self._pinned_shard(), build)
        if isinstance(replies, Unserved):
            return replies
        flags: list[bool] = []
        for chunk, reply in zip(self._chunks(hexes), replies, strict=True):
            if isinstance(reply, BaseException):
                self.other_errors += 1
                flags.extend([False] * len(chunk))
            else:
                flags.extend(bool(v) for v in reply)
        return flags

    async def put_many(
        self, items: Sequence[tuple[BlockHash, bytes]], ttl_s: int | None = None
    ) -> int:
        """Pinned flags first (one call to the pinned set's shard), then the SETs grouped by shard.
        If the flags cannot be read, that shard is not called again (its writes are counted with
        the failed read) and the other shards' blocks are written with the TTL."""
        if not items:
            return 0
        keys = [self.key(h) for h, _ in items]
        ttl = ttl_s or self.ttl_s
        flags = await self._pinned_flags([h.hex() for h, _ in items])
        pinned = [False] * len(items) if isinstance(flags, Unserved) else flags
        written = 0

        async def write(shard: str, idx: list[int]) -> None:
            nonlocal written

            def build(pipe: Any) -> None:
                for i in idx:
                    pipe.set(keys[i], items[i][1], ex=None if pinned[i] else ttl)

            if isinstance(flags, Unserved) and shard == self._pinned_shard():
                replies: list[Any] | Unserved = flags
            else:
                replies = await self._run(shard, build)
            if isinstance(replies, Unserved):
                self._count_unserved_writes(replies, len(idx))
                return
            self._count_reply_errors(replies)
            for i, r in zip(idx, replies, strict=True):
                if not isinstance(r, BaseException):
                    written += 1
                    self._stats.bytes_stored += len(items[i][1])

        await asyncio.gather(*(write(s, idx) for s, idx in self._route(keys).items()))
        self._stats.puts += written
        return written

    async def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        return (await self.presence(hashes)).stored

    async def presence(self, hashes: Sequence[BlockHash]) -> Presence:
        """``contains``, with the hashes of shards whose breaker short-circuited the call."""
        if not hashes:
            return Presence.answered([])
        keys = [self.key(h) for h in hashes]
        found = [False] * len(keys)
        short = [False] * len(keys)

        async def exists(shard: str, idx: list[int]) -> None:
            def build(pipe: Any) -> None:
                for i in idx:
                    pipe.exists(keys[i])

            replies = await self._run(shard, build)
            if isinstance(replies, Unserved):
                self._stats.get_errors += int(replies.error is not None)
                if replies.error is None:  # the breaker is open: nothing was sent
                    for i in idx:
                        short[i] = True
                return
            for i, r in zip(idx, replies, strict=True):
                if isinstance(r, BaseException):
                    self.other_errors += 1
                    self._stats.get_errors += 1
                else:
                    found[i] = bool(r)

        await asyncio.gather(*(exists(s, idx) for s, idx in self._route(keys).items()))
        return Presence(found, short)

    async def _write_op(
        self,
        hashes: Sequence[BlockHash],
        on_pinned_set: Callable[[Any, Sequence[str]], None],
        on_keys: Callable[[Any, Sequence[str]], None],
    ) -> None:
        """A pipelined maintenance write (delete/pin/unpin), one call per shard: ``on_pinned_set``
        queues the pinned-set commands (on its shard), ``on_keys`` the block-key commands of each
        shard. Never raises."""
        if not hashes:
            return
        keys = [self.key(h) for h in hashes]
        hexes = [h.hex() for h in hashes]
        groups = self._route(keys)
        groups.setdefault(self._pinned_shard(), [])

        async def run(shard: str, idx: list[int]) -> None:
            def build(pipe: Any) -> None:
                if shard == self._pinned_shard():
                    for chunk in self._chunks(hexes):
                        on_pinned_set(pipe, chunk)
                for chunk in self._chunks([keys[i] for i in idx]):
                    on_keys(pipe, chunk)

            replies = await self._run(shard, build)
            if isinstance(replies, Unserved):
                self._stats.put_errors += int(replies.error is not None)
            else:
                self._count_reply_errors(replies)

        await asyncio.gather(*(run(s, idx) for s, idx in groups.items()))

    async def delete(self, hashes: Sequence[BlockHash]) -> None:
        await self._write_op(
            hashes,
            lambda pipe, hexes: pipe.srem(self.pinned_set_key, *hexes),
            lambda pipe, keys: pipe.delete(*keys),
        )

    async def pin(self, hashes: Sequence[BlockHash]) -> None:
        def persist(pipe: Any, keys: Sequence[str]) -> None:
            for k in keys:
                pipe.persist(k)

        await self._write_op(
            hashes, lambda pipe, hexes: pipe.sadd(self.pinned_set_key, *hexes), persist
        )

    async def unpin(self, hashes: Sequence[BlockHash]) -> None:
        def expire(pipe: Any, keys: Sequence[str]) -> None:
            if self.ttl_s:
                for k in keys:
                    pipe.expire(k, self.ttl_s)

        await self._write_op(
            hashes, lambda pipe, hexes: pipe.srem(self.pinned_set_key, *hexes), expire
        )

    def _breaker_stats(self) -> dict[str, object]:
        return self.breaker.stats()

    def stats(self) -> dict[str, object]:
        d = self._stats.as_dict()
        d.update(
            backend=self.backend,
            short_circuits=self.short_circuits,
            refused_writes=self.refused_writes,
            other_errors=self.other_errors,
        )
        d.update(self._breaker_stats())
        return d

    async def close(self) -> None:
        try:
            await self._client.aclose()
        finally:
            await self._client.connection_pool.disconnect()
