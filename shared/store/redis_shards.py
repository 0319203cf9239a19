"""RedisShards: calls to the shards of a Redis store under one failure policy (a per-call
deadline, retries, a circuit breaker per shard, and the counting of what failed).

The engine must never fail a request because of the store. The policy is applied per
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
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar

from kvserve.shared.store.base import StoreStats
from kvserve.shared.store.breaker import CircuitBreaker
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


@dataclasses.dataclass(frozen=True)
class Unserved:
    """A call to a shard that produced no replies: short-circuited by an open breaker (``error``
    None, nothing was sent) or failed as a whole (``error``: transport, deadline, error reply)."""

    error: BaseException | None


class RedisShards:
    """The failure policy over a client's shards; a subclass says how keys are routed and how
    a pipeline to a shard is made (one server: RedisStore; a cluster: RedisClusterStore)."""

    # What a call to a shard may raise that the store swallows, and which of those are transport
    # failures (breaker failures). RedisClusterStore adds the cluster client's own errors.
    transport_errors: ClassVar[tuple[type[BaseException], ...]] = TRANSPORT_ERRORS
    store_errors: ClassVar[tuple[type[BaseException], ...]] = STORE_ERRORS
    SERVER: ClassVar[str] = "server"  # the one shard of a single-server store

    def __init__(
        self,
        client: Any,
        namespace: str,
        timeout_s: float,
        attempts: int,
        backoff_s: float,
        breaker: CircuitBreaker | None,
    ) -> None:
        self._client = client
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.breaker = breaker or CircuitBreaker()
        self._stats = StoreStats()
        self.short_circuits = 0
        self.refused_writes = 0
        self.other_errors = 0

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

    def _breaker_stats(self) -> dict[str, object]:
        return self.breaker.stats()

    def failure_stats(self) -> dict[str, object]:
        """The policy's own counters and its breakers'."""
        d: dict[str, object] = dict(
            short_circuits=self.short_circuits,
            refused_writes=self.refused_writes,
            other_errors=self.other_errors,
        )
        d.update(self._breaker_stats())
        return d
