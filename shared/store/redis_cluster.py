"""RedisClusterStore: blocks spread over the masters of a Redis Cluster, with RedisStore's failure
policy applied per master.

URL: ``redis+cluster://host:port[,host2:port2...]/?ttl=&timeout=&attempts=&backoff=&failures=
&cooldown=&namespace=&batch=`` (``rediss+cluster://`` for TLS; user:password@ before the first
node). The netloc lists startup nodes; the client discovers the rest from ``CLUSTER SLOTS``.

Keys are RedisStore's (``{namespace}:blk:{hex}``, no hash tags), so CRC16 spreads blocks over all
16384 slots and so over every master; the pinned set is one key, in one slot, on one master.

Batching: a call groups its keys by the master that owns their slot and sends one pipeline per
master (GET / SET EX / EXISTS / PERSIST / EXPIRE / DEL per key; MGET cannot span slots), the
masters concurrently: a batch of N blocks costs one round trip per master, not N.

Failure policy: RedisStore's, with a *shard* being one master (redis.py holds the policy; this
class only routes keys and builds pipelines). Each master has its own deadline per call, retries and
circuit breaker, closed only by a probe that SETs and GETs a fresh key in one of that master's
slots. Until the slot map is known (first call, or after redis-py drops it) every key goes to one
pseudo-shard ``"cluster"`` with its own breaker, whose call (re)discovers the topology.

When a master dies and the cluster has no replica of it (what the tests run):

- Its keys are gone: no replica, and a restarted master comes back empty (no persistence). Reads of
  them are misses and writes to its slots are skipped and counted (``put_errors``, then
  ``skipped_writes`` while its breaker is open); nothing is raised.
- The other masters keep serving their keys in the same calls: only the dead master's breaker
  opens. This needs ``cluster-require-full-coverage no`` on the servers; with the default ``yes``,
  once ``cluster-node-timeout`` has passed the survivors refuse every command with CLUSTERDOWN. The
  store then answers misses for every key (``get_errors``, ``other_errors``) and skips writes, but
  no breaker opens: the servers answer.
- If it is the master of the pinned set, pins cannot be read: blocks are written with the TTL (on
  the other masters) until it is back, and its pins are lost with its data.
- Restarted at the same address, it rejoins with its slots (``nodes.conf``); after the cooldown the
  probe round-trips there and its breaker closes. With replicas, a failover moves its slots: the
  probe refreshes the slot map first, so keys follow their slots to the promoted replica, and
  redis-py follows MOVED replies in between.

``put_many`` reads the pinned flags from the pinned set's master, then writes: two calls, each under
its own deadline. ``stats()`` reports every breaker summed (``breaker_state`` is the worst of them)
and ``node_breakers``: each master's breaker state.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

from kvserve.shared.store.breaker import CircuitBreaker
from kvserve.shared.store.redis import RedisStore, breaker_from_settings, split_store_query
from kvserve.shared.store.redis_shards import STORE_ERRORS, TRANSPORT_ERRORS
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, SlotNotCoveredError

SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
TOPOLOGY = "cluster"  # the pseudo-shard of every key while the slot map is unknown
UNCOVERED = "uncovered"  # the pseudo-shard of keys in slots no master owns

# RedisClusterException: no startup node reachable, slot not covered (not a RedisError).
CLUSTER_TRANSPORT_ERRORS = (*TRANSPORT_ERRORS, RedisClusterException)


def parse_startup_nodes(netloc_hosts: str) -> list[tuple[str, int]]:
    """``"h1:p1,[::1]:p2,h3"`` -> [(host, port), ...] (port 6379 when absent)."""
    nodes: list[tuple[str, int]] = []
    for part in netloc_hosts.split(","):
        part = part.strip()
        if not part:
            continue
        parsed = urlsplit(f"//{part}")
        if not parsed.hostname:
            raise ValueError(f"bad cluster node {part!r}")
        nodes.append((parsed.hostname, parsed.port or 6379))
    if not nodes:
        raise ValueError("redis+cluster URL names no node")
    return nodes


class RedisClusterStore(RedisStore):
    backend: ClassVar[str] = "redis+cluster"
    transport_errors: ClassVar[tuple[type[BaseException], ...]] = CLUSTER_TRANSPORT_ERRORS
    store_errors: ClassVar[tuple[type[BaseException], ...]] = (
        *STORE_ERRORS,
        RedisClusterException,
    )

    def __init__(
        self,
        client: RedisCluster,
        *,
        breaker: CircuitBreaker | None = None,
        breaker_factory: Callable[[], CircuitBreaker] | None = None,
        **kwargs: Any,
    ) -> None:
        """``client`` is owned by the store (``close`` closes it). ``breaker`` guards topology
        discovery; ``breaker_factory`` makes each master's breaker. Other keywords: RedisStore's."""
        self._new_breaker = breaker_factory or CircuitBreaker
        super().__init__(client, breaker=breaker or self._new_breaker(), **kwargs)
        self._client: RedisCluster = client
        self.node_breakers: dict[str, CircuitBreaker] = {}

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        breaker: CircuitBreaker | None = None,
        breaker_factory: Callable[[], CircuitBreaker] | None = None,
        **overrides: Any,
    ) -> RedisClusterStore:
        """See the module docstring for the URL. Query parameters the store does not read go to
        redis-py; ``overrides`` are constructor keywords and win over the URL."""
        kw, breaker_settings, clean = split_store_query(url)
        kw.update(overrides)
        parts = urlsplit(clean)
        scheme = SCHEMES.get(parts.scheme.lower())
        if scheme is None:
            raise ValueError(f"not a cluster URL: {url!r}")
        if parts.path.strip("/") not in ("", "0"):
            raise ValueError(f"Redis Cluster has only database 0, got {url!r}")
        userinfo, at, hosts = parts.netloc.rpartition("@")
        (host, port), *others = parse_startup_nodes(hosts)
        netloc = (
            f"{userinfo}{at}{host}:{port}" if ":" not in host else f"{userinfo}{at}[{host}]:{port}"
        )
        first = urlunsplit((scheme, netloc, "", parts.query, ""))
        timeout = float(kw.get("timeout_s", 0.5))
        client = RedisCluster.from_url(
            first,
            startup_nodes=[ClusterNode(h, p) for h, p in others],
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            require_full_coverage=False,  # serve the covered slots when a master is gone
        )
        if breaker_factory is None:
            settings = breaker_settings

            def breaker_factory() -> CircuitBreaker:
                return breaker_from_settings(settings)

        return cls(client, breaker=breaker, breaker_factory=breaker_factory, **kw)

    # -- routing ---------------------------------------------------------------------------------

    def _topology_known(self) -> bool:
        return self._client.nodes_manager.default_node is not None

    def _node_of(self, key: str) -> str:
        try:
            node = self._client.nodes_manager.get_node_from_slot(self._client.keyslot(key))
        except SlotNotCoveredError:
            return UNCOVERED
        return str(node.name)

    def _route(self, keys: Sequence[str]) -> dict[str, list[int]]:
        if not self._topology_known():
            return {TOPOLOGY: list(range(len(keys)))}
        if self.breaker.closed:
            self.breaker.record_success()  # discovery worked (perhaps inside a master's call)
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(self._node_of(k), []).append(i)
        return groups

    def _pinned_shard(self) -> str:
        return self._node_of(self.pinned_set_key) if self._topology_known() else TOPOLOGY

    def _breaker_for(self, shard: str) -> CircuitBreaker:
        if shard == TOPOLOGY:
            return self.breaker
        breaker = self.node_breakers.get(shard)
        if breaker is None:
            breaker = self.node_breakers[shard] = self._new_breaker()
        return breaker

    def _pipeline(self, shard: str) -> Any:
        # A cluster pipeline routes each command by its slot; the caller queues one master's keys.
        return self._client.pipeline()

    multi_key_exists: ClassVar[bool] = False  # a master's keys lie in many slots

    def _queue_reads(self, pipe: Any, keys: Sequence[str]) -> None:
        for k in keys:
            pipe.get(k)

    def _read_values(self, replies: list[Any], keys: Sequence[str]) -> list[Any]:
        return replies

    # -- probe -----------------------------------------------------------------------------------

    async def _probe_key(self, shard: str) -> str | None:
        if shard == TOPOLOGY:
            await self._client.initialize()
            return f"{self.namespace}:probe:{uuid.uuid4().hex}"
        # A failover or resharding may have moved the master's slots: read the slot map again.
        await self._client.nodes_manager.initialize()
        owned = {
            slot
            for slot, nodes in self._client.nodes_manager.slots_cache.items()
            if nodes and nodes[0].name == shard
        }
        if not owned:
            return None
        for _ in range(1 << 20):  # about 16384 / len(owned) tries
            key = f"{self.namespace}:probe:{uuid.uuid4().hex}"
            if self._client.keyslot(key) in owned:
                return key
        return None

    async def _drop_idle_connections(self, shard: str) -> None:
        node = self._client.nodes_manager.get_node(node_name=shard)
        if node is not None:
            await node.disconnect_free_connections()

    # -- stats, close ----------------------------------------------------------------------------

    def _breaker_stats(self) -> dict[str, object]:
        breakers = [self.breaker, *self.node_breakers.values()]
        states = {b.state for b in breakers}
        worst = "open" if "open" in states else "half_open" if "half_open" in states else "closed"
        return {
            "breaker_state": worst,
            "breaker_opens": sum(b.opens for b in breakers),
            "breaker_probes": sum(b.probes for b in breakers),
            "breaker_probe_failures": sum(b.probe_failures for b in breakers),
            "consecutive_failures": max(b.consecutive_failures for b in breakers),
            "node_breakers": {name: b.state for name, b in sorted(self.node_breakers.items())},
        }

    async def close(self) -> None:
        await self._client.aclose()
