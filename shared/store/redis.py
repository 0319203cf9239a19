"""RedisStore: blocks in one Redis server, behind a per-call timeout, retries and a circuit breaker.

Keys: ``{namespace}:blk:{hex}`` (namespace ``kvserve:v1`` by default) hold the encoded block;
``{namespace}:pinned`` is a set of the hex hashes that are pinned. Unpinned blocks are written
with ``EX ttl``; pinned blocks carry no TTL (``pin`` PERSISTs them, ``unpin`` restores the TTL).
Redis owns memory eviction (run it with ``maxmemory`` + ``allkeys-lru``); this client never evicts.

Failure policy (the engine must never fail a request because of the store):

- Every call runs under one deadline of ``timeout_s`` (asyncio.wait_for) that covers up to
  ``attempts`` tries with exponential backoff from ``backoff_s``; redis-py's own retries are off.
- A transport failure (connection refused/reset, timeout) counts as ``get_errors`` / ``put_errors``
  and as a breaker failure; reads answer misses, writes are skipped. Nothing is raised.
- Redis refusing writes (``OOM`` under ``maxmemory`` + ``noeviction``, ``READONLY`` replica) skips
  those writes, counted in ``skipped_writes`` / ``refused_writes``; the server is reachable, so this
  is not a breaker failure. Other server error replies count as errors but not breaker failures.
- While the breaker is open every call is short-circuited (``short_circuits``): misses, skipped
  writes. After the cooldown one caller runs a probe (SET then GET of a fresh probe key that must
  round-trip) and only its success closes the breaker.

``bytes_stored`` is the bytes this client has written (Redis may since have evicted or expired
them); the server's own usage is in ``INFO memory``.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from kvserve.shared.store.base import KEY_NAMESPACE, BlockStore, StoreStats, block_key
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


def is_refused_write(exc: BaseException) -> bool:
    """Redis answered but will not take writes: OOM (maxmemory + noeviction) or READONLY."""
    if isinstance(exc, OutOfMemoryError | ReadOnlyError):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(("OOM", "READONLY"))


class RedisStore(BlockStore):
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        ttl_s: int | None = 86400,
        timeout_s: float = 0.5,
        attempts: int = 2,
        backoff_s: float = 0.01,
        breaker: CircuitBreaker | None = None,
        namespace: str = KEY_NAMESPACE,
        batch_size: int = 256,
    ) -> None:
        """``client`` is owned by the store from now on (``close`` closes it)."""
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
        parts = urlsplit(url)
        ours = {"ttl", "timeout", "attempts", "backoff", "failures", "cooldown", "namespace"}
        ours.add("batch")
        q = parse_qsl(parts.query)
        mine = {k: v for k, v in q if k in ours}
        rest = [(k, v) for k, v in q if k not in ours]
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
        kw.update(overrides)
        if breaker is None:
            breaker = CircuitBreaker(
                failure_threshold=int(mine.get("failures", 5)),
                cooldown_s=float(mine.get("cooldown", 5.0)),
            )
        timeout = float(kw.get("timeout_s", 0.5))
        pool = aioredis.ConnectionPool.from_url(
            clean,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )
        client = aioredis.Redis(connection_pool=pool)
        return cls(client, breaker=breaker, **kw)

    # -- keys ------------------------------------------------------------------------------------

    def key(self, h: bytes) -> str:
        return block_key(BlockHash(h), self.namespace)

    @property
    def pinned_set_key(self) -> str:
        return _pinned_set_key(self.namespace)

    def _chunks(self, seq: Sequence[T]) -> list[Sequence[T]]:
        n = self.batch_size
        return [seq[i : i + n] for i in range(0, len(seq), n)]

    # -- failure handling ------------------------------------------------------------------------

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` with retries on transport errors, all under one ``timeout_s`` deadline."""

        async def tries() -> T:
            delay = self.backoff_s
            for i in range(self.attempts):
                try:
                    return await fn()
                except TRANSPORT_ERRORS:
                    if i == self.attempts - 1:
                        raise
                    await asyncio.sleep(delay)
                    delay *= 2
            raise AssertionError("unreachable")

        return await asyncio.wait_for(tries(), self.timeout_s)

    async def _available(self) -> bool:
        """True when a call may go to Redis now; runs the probe when the cooldown is over."""
        if self.breaker.closed:
            return True
        if self.breaker.begin_probe():
            ok = False
            try:
                ok = await self._probe()
            finally:  # also when the caller is cancelled: never leave the breaker half-open
                if ok:
                    self.breaker.probe_succeeded()
                else:
                    self.breaker.probe_failed()
            if ok:
                return True
        self.short_circuits += 1
        return False

    async def _probe(self) -> bool:
        """SET a fresh probe key, GET it back, compare; True only on an exact round trip."""
        key = f"{self.namespace}:probe:{uuid.uuid4().hex}"
        token = os.urandom(16)
        # Connections in the pool may predate the outage; start the probe on fresh ones.
        await self._client.connection_pool.disconnect(inuse_connections=False)

        async def round_trip() -> bool:
            await self._client.set(key, token, px=max(1000, int(self.timeout_s * 10_000)))
            got = await self._client.get(key)
            await self._client.delete(key)
            return got == token

        try:
            return await self._call(round_trip)
        except STORE_ERRORS:
            return False

    def _failed(self, exc: BaseException) -> None:
        """Account a failed call: transport errors feed the breaker, server replies do not."""
        if isinstance(exc, TRANSPORT_ERRORS):
            self.breaker.record_failure()
        else:
            self.other_errors += 1

    # -- BlockStore ------------------------------------------------------------------------------

    async def get_many(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        n = len(hashes)
        if n == 0:
            return []
        if not await self._available():
            self._stats.misses += n
            return [None] * n
        keys = [self.key(h) for h in hashes]

        async def mget() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for chunk in self._chunks(keys):
                pipe.mget(chunk)
            out: list[Any] = []
            for part in await pipe.execute():
                out.extend(part)
            return out

        try:
            values = await self._call(mget)
        except STORE_ERRORS as e:
            self._failed(e)
            self._stats.get_errors += 1
            self._stats.misses += n
            return [None] * n
        self.breaker.record_success()
        result: list[bytes | None] = [bytes(v) if v is not None else None for v in values]
        hits = sum(v is not None for v in result)
        self._stats.hits += hits
        self._stats.misses += n - hits
        return result

    async def put_many(self, items: Sequence[tuple[BlockHash, bytes]]) -> int:
        n = len(items)
        if n == 0:
            return 0
        if not await self._available():
            self._stats.skipped_writes += n
            return 0

        async def write() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for chunk in self._chunks(items):
                pipe.smismember(self.pinned_set_key, [h.hex() for h, _ in chunk])
            pinned: list[Any] = []
            for part in await pipe.execute():
                pinned.extend(part)
            pipe = self._client.pipeline(transaction=False)
            for (h, value), is_pinned in zip(items, pinned, strict=True):
                ex = None if is_pinned else self.ttl_s
                pipe.set(self.key(h), value, ex=ex)
            return list(await pipe.execute(raise_on_error=False))

        try:
            results = await self._call(write)
        except STORE_ERRORS as e:
            self._failed(e)
            if isinstance(e, RedisError) and is_refused_write(e):
                self.refused_writes += n
                self._stats.skipped_writes += n
            else:
                self._stats.put_errors += n
            return 0
        self.breaker.record_success()
        written = 0
        for (_, value), r in zip(items, results, strict=True):
            if isinstance(r, BaseException):
                if is_refused_write(r):
                    self.refused_writes += 1
                    self._stats.skipped_writes += 1
                else:
                    self.other_errors += 1
                    self._stats.put_errors += 1
            else:
                written += 1
                self._stats.bytes_stored += len(value)
        self._stats.puts += written
        return written

    async def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        n = len(hashes)
        if n == 0:
            return []
        if not await self._available():
            return [False] * n

        async def exists() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(h))
            return list(await pipe.execute())

        try:
            found = await self._call(exists)
        except STORE_ERRORS as e:
            self._failed(e)
            self._stats.get_errors += 1
            return [False] * n
        self.breaker.record_success()
        return [bool(x) for x in found]

    async def _write_op(self, hashes: Sequence[BlockHash], build: Callable[[Any], None]) -> None:
        """Run a pipelined maintenance write (delete/pin/unpin); never raises."""
        if not hashes or not await self._available():
            return

        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            build(pipe)
            return list(await pipe.execute(raise_on_error=False))

        try:
            results = await self._call(run)
        except STORE_ERRORS as e:
            self._failed(e)
            self._stats.put_errors += 1
            return
        self.breaker.record_success()
        for r in results:
            if isinstance(r, BaseException):
                if is_refused_write(r):
                    self.refused_writes += 1
                    self._stats.skipped_writes += 1
                else:
                    self.other_errors += 1
                    self._stats.put_errors += 1

    async def delete(self, hashes: Sequence[BlockHash]) -> None:
        def build(pipe: Any) -> None:
            for chunk in self._chunks(hashes):
                pipe.delete(*[self.key(h) for h in chunk])
                pipe.srem(self.pinned_set_key, *[h.hex() for h in chunk])

        await self._write_op(hashes, build)

    async def pin(self, hashes: Sequence[BlockHash]) -> None:
        def build(pipe: Any) -> None:
            for chunk in self._chunks(hashes):
                pipe.sadd(self.pinned_set_key, *[h.hex() for h in chunk])
            for h in hashes:
                pipe.persist(self.key(h))

        await self._write_op(hashes, build)

    async def unpin(self, hashes: Sequence[BlockHash]) -> None:
        def build(pipe: Any) -> None:
            for chunk in self._chunks(hashes):
                pipe.srem(self.pinned_set_key, *[h.hex() for h in chunk])
            if self.ttl_s:
                for h in hashes:
                    pipe.expire(self.key(h), self.ttl_s)

        await self._write_op(hashes, build)

    def stats(self) -> dict[str, object]:
        d = self._stats.as_dict()
        d.update(
            backend="redis",
            short_circuits=self.short_circuits,
            refused_writes=self.refused_writes,
            other_errors=self.other_errors,
        )
        d.update(self.breaker.stats())
        return d

    async def close(self) -> None:
        try:
            await self._client.aclose()
        finally:
            await self._client.connection_pool.disconnect()
