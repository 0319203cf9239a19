"""RedisStore: blocks in one Redis server, behind a per-call timeout, retries and a circuit breaker.

Keys: ``{namespace}:blk:{hex}`` (namespace ``kvserve:v1`` by default) hold the encoded block;
``{namespace}:pinned`` is a set of the hex hashes that are pinned. Unpinned blocks are written
with ``EX ttl``; pinned blocks carry no TTL (``pin`` PERSISTs them, ``unpin`` restores the TTL).
Redis owns memory eviction (run it with ``maxmemory`` + ``allkeys-lru``, on a server apart from
the bus's, which must never evict: docs/deployment.md); this client never evicts.

Failure policy: redis_shards.py (RedisShards), per shard: the one server here, each master in
RedisClusterStore.

``bytes_stored`` is the bytes this client has written (Redis may since have evicted or expired
them); the server's own usage is in ``INFO memory``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, ClassVar, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis.asyncio as aioredis
from kvserve.shared.store.base import KEY_NAMESPACE, BlockStore, Presence, block_key
from kvserve.shared.store.base import pinned_set_key as _pinned_set_key
from kvserve.shared.store.breaker import CircuitBreaker
from kvserve.shared.store.bulk_reader import BulkReader, Endpoint
from kvserve.shared.store.hashing import BlockHash
from kvserve.shared.store.redis_shards import RedisShards, Unserved
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

T = TypeVar("T")

# The query parameters the store reads itself; the rest go to redis-py.
STORE_QUERY_KEYS = frozenset(
    {"ttl", "timeout", "attempts", "backoff", "failures", "cooldown", "namespace", "batch"}
)


def split_store_query(url: str) -> tuple[dict[str, Any], dict[str, str], str]:
    """Split a store URL into (constructor keywords, breaker settings, URL for redis-py).

    Constructor keywords come from ``ttl timeout attempts backoff namespace batch``; breaker
    settings are ``failures`` and ``cooldown``; every other query parameter stays in the URL."""
    parts = urlsplit(url)
    q = parse_qsl(parts.query)
    mine = {k: v for k, v in q if k in STORE_QUERY_KEYS}
    rest = [(k, v) for k, v in q if k not in STORE_QUERY_KEYS]
    # Everything before the query as written: urlunsplit turns unix:///run/r.sock (no host)
    # into unix:/run/r.sock, which redis-py refuses.
    base = url.split("#", 1)[0].split("?", 1)[0]
    clean = f"{base}?{urlencode(rest)}" if rest else base
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


class RedisStore(RedisShards, BlockStore):
    backend: ClassVar[str] = "redis"
    # Whether one EXISTS may name several keys (not in a cluster: they may lie in other slots).
    multi_key_exists: ClassVar[bool] = True

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
        super().__init__(client, namespace, timeout_s, attempts, backoff_s, breaker)
        self.ttl_s = ttl_s or None
        self.batch_size = batch_size
        # Loads' gets, read in place (bulk_reader.py); None: through redis-py (TLS, a cluster).
        self.bulk: BulkReader | None = None

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
        store = cls(client, breaker=breaker or breaker_from_settings(breaker_settings), **kw)
        store.bulk = _bulk_reader(pool)
        return store

    # -- keys ------------------------------------------------------------------------------------

    def key(self, h: bytes) -> str:
        return block_key(BlockHash(h), self.namespace)

    @property
    def pinned_set_key(self) -> str:
        return _pinned_set_key(self.namespace)

    def _chunks(self, seq: Sequence[T]) -> list[Sequence[T]]:
        n = self.batch_size
        return [seq[i : i + n] for i in range(0, len(seq), n)]

    # -- reads -----------------------------------------------------------------------------------

    def _queue_reads(self, pipe: Any, keys: Sequence[str]) -> None:
        for chunk in self._chunks(keys):
            pipe.mget(chunk)

    def _read_values(self, replies: list[Any], keys: Sequence[str]) -> list[Any]:
        """One value (bytes, None or an exception) per key from ``_queue_reads``' replies."""
        out: list[Any] = []
        for chunk, reply in zip(self._chunks(keys), replies, strict=True):
            out.extend([reply] * len(chunk) if isinstance(reply, BaseException) else reply)
        return out

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

    async def connect(self, read_bytes: int = 0) -> None:
        """A pooled connection for presence and writes (connect, SELECT, the client's SETINFO:
        ~1.5 ms on the first lookup otherwise) and one for the bulk reader's loads, with its
        reply buffers for chunks of `read_bytes`."""
        try:
            await asyncio.wait_for(self._client.ping(), self.timeout_s)
            if self.bulk is not None:
                await asyncio.wait_for(self.bulk.open(read_bytes), self.timeout_s)
        except Exception:  # the first real call finds out that the store is down
            pass

    def recycle(self, values: Sequence[bytes | memoryview | None]) -> None:
        if self.bulk is not None:
            self.bulk.recycle(values)

    async def get_views(self, hashes: Sequence[BlockHash]) -> Sequence[bytes | memoryview | None]:
        """As get_many, through the bulk reader when there is one: each value a view of its
        chunk's reply buffer (one MGET per `batch_size` keys, on one connection)."""
        if self.bulk is None or not hashes:
            return await self.get_many(hashes)
        bulk = self.bulk
        keys = [self.key(h) for h in hashes]
        if not await self._available(self.SERVER):
            self._stats.misses += len(keys)
            return [None] * len(keys)

        async def read() -> list[memoryview | None]:
            out: list[memoryview | None] = []
            for chunk in self._chunks(keys):
                out += await bulk.mget(chunk)
            return out

        try:
            values = await self._call(read)
        except self.store_errors as e:
            self._failed(e, self.SERVER)
            self._stats.get_errors += 1
            self._stats.misses += len(keys)
            return [None] * len(keys)
        hits = sum(v is not None for v in values)
        self._stats.hits += hits
        self._stats.misses += len(keys) - hits
        return values

    async def stream_views(
        self, hashes: Sequence[BlockHash], chunk: int
    ) -> AsyncGenerator[Sequence[bytes | memoryview | None], None]:
        """Every chunk's MGET sent at once on one connection of the bulk reader (the server
        answers them one after the other: none waits behind another's interleaved reply), each
        chunk yielded when its reply is in. Under the failure policy, except that a stream is
        not retried: a failure answers the chunks not yet yielded with misses."""
        if self.bulk is None:
            async for values in super().stream_views(hashes, chunk):
                yield values
            return
        keys = [self.key(h) for h in hashes]
        chunks = [keys[i : i + chunk] for i in range(0, len(keys), chunk)]
        if not await self._available(self.SERVER):
            self._stats.misses += len(keys)
            for c in chunks:
                yield [None] * len(c)
            return
        served = 0
        stream = self.bulk.mget_chunks(chunks)
        try:
            while True:
                try:
                    async with asyncio.timeout(self.timeout_s):  # no task per chunk (wait_for)
                        values = await anext(stream)
                except StopAsyncIteration:
                    break
                hits = sum(v is not None for v in values)
                self._stats.hits += hits
                self._stats.misses += len(values) - hits
                served += 1
                yield values
        except self.store_errors as e:
            self._failed(e, self.SERVER)
            self._stats.get_errors += 1
            for c in chunks[served:]:
                self._stats.misses += len(c)
                yield [None] * len(c)
        finally:
            await stream.aclose()

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
        """``contains``, with the hashes of shards whose breaker short-circuited the call.

        Where the server takes multi-key commands (one server, not a cluster), one ``EXISTS``
        of all of a chunk's keys comes first: when it counts them all (the usual hit), that is
        the answer, at a tenth of the cost of one ``EXISTS`` per key; a chunk whose count falls
        short is asked again key by key."""
        if not hashes:
            return Presence.answered([])
        keys = [self.key(h) for h in hashes]
        found = [False] * len(keys)
        short = [False] * len(keys)

        async def exists(shard: str, idx: list[int]) -> None:
            if self.multi_key_exists:
                idx = await self._fully_present(shard, idx, keys, found, short)
            if not idx:
                return

            def build(pipe: Any) -> None:
                for i in idx:
                    pipe.exists(keys[i])

            replies = await self._run(shard, build)
            if isinstance(replies, Unserved):
                self._unserved(replies, idx, short)
                return
            for i, r in zip(idx, replies, strict=True):
                if isinstance(r, BaseException):
                    self.other_errors += 1
                    self._stats.get_errors += 1
                else:
                    found[i] = bool(r)

        await asyncio.gather(*(exists(s, idx) for s, idx in self._route(keys).items()))
        return Presence(found, short)

    async def _fully_present(
        self, shard: str, idx: list[int], keys: list[str], found: list[bool], short: list[bool]
    ) -> list[int]:
        """Marks `found` for the chunks of `idx` whose keys all exist (one multi-key EXISTS
        each); the indices still to ask key by key (none where the call was unserved)."""
        chunks = self._chunks(idx)

        def build(pipe: Any) -> None:
            for chunk in chunks:
                pipe.exists(*(keys[i] for i in chunk))

        replies = await self._run(shard, build)
        if isinstance(replies, Unserved):
            self._unserved(replies, idx, short)
            return []
        rest: list[int] = []
        for chunk, count in zip(chunks, replies, strict=True):
            if isinstance(count, int) and count == len(chunk):
                for i in chunk:
                    found[i] = True
            else:
                rest.extend(chunk)
        return rest

    def _unserved(self, unserved: Unserved, idx: list[int], short: list[bool]) -> None:
        """Accounts a presence call unserved (`short` marks idx where the breaker sent nothing)."""
        self._stats.get_errors += int(unserved.error is not None)
        if unserved.error is None:  # the breaker is open: nothing was sent
            for i in idx:
                short[i] = True

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

    def stats(self) -> dict[str, object]:
        d = self._stats.as_dict()
        d["backend"] = self.backend
        d.update(self.failure_stats())
        return d

    async def _drop_idle_connections(self, shard: str) -> None:
        await super()._drop_idle_connections(shard)
        if self.bulk is not None:
            self.bulk.drop_idle()

    async def close(self) -> None:
        if self.bulk is not None:
            self.bulk.drop_idle()
        try:
            await self._client.aclose()
        finally:
            await self._client.connection_pool.disconnect()


def _bulk_reader(pool: aioredis.ConnectionPool) -> BulkReader | None:
    """A BulkReader to the pool's server, when its connections are plain TCP or a Unix socket
    (not TLS) speaking RESP2 with no options the reader would ignore; else None."""
    kw = pool.connection_kwargs
    plain = pool.connection_class in (aioredis.Connection, aioredis.UnixDomainSocketConnection)
    if not plain or kw.get("protocol") not in (None, 2, "2") or kw.get("credential_provider"):
        return None
    endpoint = Endpoint(
        host=kw.get("host", "localhost"),
        port=int(kw.get("port", 6379)),
        path=kw.get("path"),
        db=int(kw.get("db", 0) or 0),
        username=kw.get("username"),
        password=kw.get("password"),
    )
    return BulkReader(endpoint)
