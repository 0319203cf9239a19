"""Contract tests shared by every BlockStore backend, plus the Redis failure policy (timeouts,
circuit breaker, OOM refusals, restart) against Redis servers the tests start themselves, and the
Redis Cluster backend (slot spreading, per-master batching, a master killed and restarted)."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from kvserve.services.bench.lib.process import free_port
from kvserve.services.bench.lib.redis_cluster import RedisCluster
from kvserve.services.bench.lib.redis_server import RedisServer, redis_answers
from kvserve.shared.store.backends import open_store, parse_size
from kvserve.shared.store.base import BlockStore, Presence
from kvserve.shared.store.breaker import CircuitBreaker
from kvserve.shared.store.disk import DiskStore
from kvserve.shared.store.hashing import BlockHash
from kvserve.shared.store.memory import MemoryStore
from kvserve.shared.store.redis import RedisStore
from kvserve.shared.store.redis_cluster import RedisClusterStore
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

LOCAL_REDIS = "redis://127.0.0.1:6379/15"


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"block-{i}".encode()).digest())


def val(i: int, size: int = 100) -> bytes:
    return (f"v{i}:".encode() * size)[:size]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


async def drop_namespace(url: str, namespace: str) -> None:
    """Delete the namespace's keys on one server (one key per DEL: a cluster node refuses a DEL
    whose keys are in different slots)."""
    client = aioredis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{namespace}:*")]
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.delete(k)
        await pipe.execute()
    finally:
        await client.aclose()


# -- backends under one contract ----------------------------------------------------------------


async def drop_cluster_namespace(cluster: RedisCluster, namespace: str) -> None:
    for port in cluster.ports:
        await drop_namespace(f"redis://127.0.0.1:{port}/0", namespace)


@pytest.fixture(
    params=[
        "memory",
        "file",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.redis),
    ]
)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BlockStore]:
    ns = f"kvtest:{uuid.uuid4().hex}"
    cleanup: Callable[[], Awaitable[None]] | None = None
    if request.param == "memory":
        s: BlockStore = open_store("memory://?max_bytes=1m")
    elif request.param == "file":
        s = open_store(f"file://{tmp_path}/blocks?max_bytes=1m")
    elif request.param == "redis":
        if not await redis_answers(LOCAL_REDIS):
            pytest.skip("no Redis at 127.0.0.1:6379")
        s = open_store(f"{LOCAL_REDIS}?ttl=100&timeout=1&namespace={ns}")
        cleanup = functools.partial(drop_namespace, LOCAL_REDIS, ns)
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        s = open_store(f"{cluster.url}/?ttl=100&timeout=1&namespace={ns}")
        assert isinstance(s, RedisClusterStore)
        cleanup = functools.partial(drop_cluster_namespace, cluster, ns)
    yield s
    if cleanup is not None:
        await cleanup()
    await s.close()


async def test_round_trip(store: BlockStore) -> None:
    items = [(h(i), val(i)) for i in range(5)]
    assert await store.put_many(items) == 5
    assert await store.get_many([h(0), h(99), h(4)]) == [val(0), None, val(4)]
    views = await store.get_views([h(4), h(99), h(0)])  # a load's read: views or bytes
    assert [None if v is None else bytes(v) for v in views] == [val(4), None, val(0)]
    chunks = [list(c) async for c in store.stream_views([h(i) for i in (0, 1, 99, 3, 4)], 2)]
    assert [[None if v is None else bytes(v) for v in c] for c in chunks] == [
        [val(0), val(1)],
        [None, val(3)],
        [val(4)],
    ]
    assert await store.contains([h(1), h(99)]) == [True, False]
    # every hash asked and answered: no breaker in the way
    assert await store.presence([h(1), h(99)]) == Presence([True, False], [False, False])
    assert await store.presence([]) == Presence([], [])
    await store.delete([h(1), h(99)])
    assert await store.get_many([h(1), h(2)]) == [None, val(2)]
    assert await store.contains([h(1)]) == [False]
    assert await store.get_many([]) == []
    assert await store.put_many([]) == 0
    st = store.stats()
    assert st["hits"] == 9 and st["misses"] == 4 and st["puts"] == 5
    for k in ("hits", "misses", "puts", "put_errors", "get_errors", "bytes_stored"):
        assert k in st
    assert st["skipped_writes"] == 0


async def test_overwrite_and_pin_of_missing(store: BlockStore) -> None:
    await store.pin([h(7)])  # pin before the block exists
    await store.put_many([(h(7), b"old")])
    await store.put_many([(h(7), b"new")])
    assert await store.get_many([h(7)]) == [b"new"]
    await store.unpin([h(7), h(8)])
    await store.delete([h(7)])
    assert await store.get_many([h(7)]) == [None]


# -- LRU by bytes (memory, file) ----------------------------------------------------------------


async def test_presence_per_hash_in_any_order(store: BlockStore) -> None:
    """Every hash answered on its own: a run of stored ones, gaps, a hash asked twice."""
    await store.put_many([(h(i), val(i)) for i in (0, 1, 2, 3, 5, 8)])
    asked = [0, 1, 2, 3, 4, 5, 6, 8, 8, 7, 3]
    assert await store.contains([h(i) for i in asked]) == [i in (0, 1, 2, 3, 5, 8) for i in asked]
    assert await store.contains([h(i) for i in (0, 1, 2, 3)]) == [True] * 4


@pytest.mark.redis
async def test_redis_presence_counts_whole_chunks_and_asks_the_rest_key_by_key() -> None:
    """One server: one multi-key EXISTS per chunk of `batch` keys; a chunk whose count falls
    short (a key absent, or a duplicate of an absent key) is asked key by key."""
    if not await redis_answers(LOCAL_REDIS):
        pytest.skip("no Redis at 127.0.0.1:6379")
    ns = f"kvtest:{uuid.uuid4().hex}"
    s = open_store(f"{LOCAL_REDIS}?ttl=100&timeout=1&namespace={ns}&batch=3")
    assert isinstance(s, RedisStore) and s.multi_key_exists
    try:
        await s.put_many([(h(i), val(i)) for i in range(6)])
        # chunks: [0 1 2] whole, [3 9 4] short, [9 9 5] short, [5 5] whole (a duplicate)
        asked = [0, 1, 2, 3, 9, 4, 9, 9, 5, 5, 5]
        assert await s.contains([h(i) for i in asked]) == [i < 6 for i in asked]
        await s.delete([h(1)])
        assert await s.contains([h(i) for i in range(6)]) == [i != 1 for i in range(6)]
    finally:
        await drop_namespace(LOCAL_REDIS, ns)
        await s.close()


def bounded(kind: str, tmp_path: Path, max_bytes: int) -> MemoryStore | DiskStore:
    if kind == "memory":
        return MemoryStore(max_bytes=max_bytes)
    return DiskStore(tmp_path / "blocks", max_bytes=max_bytes)


@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_lru_eviction_by_bytes_with_pins(kind: str, tmp_path: Path) -> None:
    s = bounded(kind, tmp_path, max_bytes=300)
    await s.put_many([(h(0), val(0)), (h(1), val(1)), (h(2), val(2))])
    assert s.lru_order() == [h(0), h(1), h(2)]
    assert await s.get_many([h(0)]) == [val(0)]  # a hit makes 0 most recent
    await s.contains([h(1)])  # contains does not touch
    assert s.lru_order() == [h(1), h(2), h(0)]

    assert await s.put_many([(h(3), val(3))]) == 1  # evicts 1, the least recently used
    assert await s.contains([h(0), h(1), h(2), h(3)]) == [True, False, True, True]

    await s.pin([h(2)])  # 2 was next; pinned, it is skipped over
    assert s.lru_order() == [h(0), h(3)]
    assert await s.put_many([(h(4), val(4, 150))]) == 1  # 150 bytes: evicts 0 and 3
    assert await s.contains([h(0), h(2), h(3), h(4)]) == [False, True, False, True]
    assert s.stats()["bytes_stored"] == 250
    assert s.stats()["evictions"] == 3

    await s.pin([h(4)])  # everything pinned: a write that does not fit is skipped
    assert await s.put_many([(h(5), val(5))]) == 0
    assert await s.put_many([(h(6), val(6, 50))]) == 1  # one that fits is taken
    assert await s.put_many([(h(7), val(7, 301))]) == 0  # larger than the store
    assert s.stats()["skipped_writes"] == 2

    await s.unpin([h(2)])  # unpinned: evictable again, as most recent
    assert s.lru_order() == [h(6), h(2)]
    await s.close()


async def test_file_store_survives_reopen(tmp_path: Path) -> None:
    s = DiskStore(tmp_path / "blocks", max_bytes=1000)
    await s.put_many([(h(i), val(i)) for i in range(5)])
    await s.pin([h(0)])
    assert await s.get_many([h(1)]) == [val(1)]
    await s.close()
    path = s.path_of(h(3))
    assert path.parent.parent.parent == tmp_path / "blocks"
    assert path.name == h(3).hex() and path.parent.name == h(3).hex()[2:4]
    (path.parent / ".tmp-crashed").write_bytes(b"partial")  # left by a crash mid-write

    again = DiskStore(tmp_path / "blocks", max_bytes=1000)
    assert await again.get_many([h(i) for i in range(6)]) == [val(i) for i in range(5)] + [None]
    assert not (path.parent / ".tmp-crashed").exists()
    assert again.stats()["bytes_stored"] == 500 and again.stats()["pinned"] == 1
    await again.close()

    small = DiskStore(tmp_path / "blocks", max_bytes=300)  # shrunk: oldest unpinned go first
    assert await small.contains([h(0)]) == [True]  # pinned survives
    assert small.stats()["bytes_stored"] <= 300
    await small.put_many([(h(10 + i), val(i)) for i in range(3)])
    assert await small.contains([h(0)]) == [True]
    await small.close()


def test_open_store_urls(tmp_path: Path) -> None:
    m = open_store("memory://?max_bytes=64k")
    assert isinstance(m, MemoryStore) and m.stats()["max_bytes"] == 65536
    d = open_store(f"file://{tmp_path}?max_bytes=2MiB")
    assert isinstance(d, DiskStore) and d.root == tmp_path and d.stats()["max_bytes"] == 2 << 20
    r = open_store("redis://127.0.0.1:1/3?ttl=60&timeout=0.1&failures=2&cooldown=0.5")
    assert isinstance(r, RedisStore)
    assert (r.ttl_s, r.timeout_s, r.breaker.failure_threshold, r.breaker.cooldown_s) == (
        60,
        0.1,
        2,
        0.5,
    )
    assert r.key(h(1)) == f"kvserve:v1:blk:{h(1).hex()}" and r.pinned_set_key == "kvserve:v1:pinned"
    assert parse_size("1g") == 1 << 30
    c = open_store("redis+cluster://127.0.0.1:7000,localhost:7001/?ttl=60&timeout=0.1&failures=2")
    assert isinstance(c, RedisClusterStore) and (c.ttl_s, c.timeout_s) == (60, 0.1)
    assert c.breaker.failure_threshold == 2 and c.stats()["backend"] == "redis+cluster"
    assert c.key(h(1)) == r.key(h(1)) and c.pinned_set_key == r.pinned_set_key
    with pytest.raises(ValueError):
        open_store("redis+cluster://127.0.0.1:7000/3")  # a cluster has only database 0
    with pytest.raises(ValueError):
        open_store("ftp://x")
    with pytest.raises(ValueError):
        open_store("file://relative/dir")


# -- Redis TTL and pins -------------------------------------------------------------------------


@pytest.fixture(params=["redis", "cluster"])
async def redis_target(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, Any]]:
    """(store URL without query, a raw redis-py client) for the local server or the test cluster;
    the namespaces the test used are its own to drop."""
    if request.param == "redis":
        if not await redis_answers(LOCAL_REDIS):
            pytest.skip("no Redis at 127.0.0.1:6379")
        url, raw = LOCAL_REDIS, aioredis.from_url(LOCAL_REDIS)
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        url = f"{cluster.url}/"
        raw = AsyncRedisCluster.from_url(f"redis://127.0.0.1:{cluster.ports[0]}")
    yield url, raw
    await raw.aclose()


@pytest.mark.redis
async def test_redis_ttl_on_unpinned_removed_on_pin(redis_target: tuple[str, Any]) -> None:
    url, raw = redis_target
    ns = f"kvtest:{uuid.uuid4().hex}"
    s = open_store(f"{url}?ttl=100&namespace={ns}")
    assert isinstance(s, RedisStore)
    keys = [s.key(h(i)) for i in range(3)]
    try:
        await s.put_many([(h(0), b"a"), (h(1), b"b")])
        assert 0 < await raw.ttl(s.key(h(0))) <= 100
        await s.pin([h(0), h(2)])
        assert await raw.ttl(s.key(h(0))) == -1
        assert await raw.smembers(s.pinned_set_key) == {h(0).hex().encode(), h(2).hex().encode()}
        await s.put_many([(h(0), b"a2"), (h(2), b"c")])  # pinned keys are written without TTL
        assert await raw.ttl(s.key(h(0))) == -1 and await raw.ttl(s.key(h(2))) == -1
        assert 0 < await raw.ttl(s.key(h(1))) <= 100
        await s.unpin([h(0)])
        assert 0 < await raw.ttl(s.key(h(0))) <= 100
        await s.delete([h(2)])
        assert await raw.smembers(s.pinned_set_key) == set()
        assert await raw.exists(s.key(h(2))) == 0
        assert s.stats()["put_errors"] == 0 and s.stats()["other_errors"] == 0
    finally:
        for k in [*keys, s.pinned_set_key]:
            await raw.delete(k)
        await s.close()


# -- failure policy ------------------------------------------------------------------------------


def test_breaker_state_machine() -> None:
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=2, cooldown_s=1.0, clock=clock)
    b.record_failure()
    b.record_success()  # a success resets the run of failures
    b.record_failure()
    assert b.closed
    b.record_failure()
    assert b.state == "open" and not b.begin_probe()
    clock.advance(1.0)
    assert b.begin_probe() and b.state == "half_open"
    assert not b.begin_probe()  # one probe at a time
    b.probe_failed()
    assert b.state == "open" and not b.probe_due()
    clock.advance(1.0)
    assert b.begin_probe()
    b.probe_succeeded()
    assert b.closed and b.consecutive_failures == 0


async def read_with(store: RedisStore, read: str, hashes: list[BlockHash]) -> list[Any]:
    """get_many, get_views, or stream_views (two hashes a chunk) flattened."""
    if read == "stream_views":
        return [v async for chunk in store.stream_views(hashes, 2) for v in chunk]
    return list(await getattr(store, read)(hashes))


@pytest.mark.parametrize("read", ["get_many", "get_views", "stream_views"])
async def test_dead_redis_misses_fast_and_opens_breaker(read: str) -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=0.2, clock=clock)
    s = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.3, breaker=breaker)
    for i in range(3):
        t0 = time.monotonic()
        assert await read_with(s, read, [h(i), h(i + 1)]) == [None, None]
        assert time.monotonic() - t0 < 0.3 + 0.2
    assert breaker.state == "open"
    st = s.stats()
    assert st["get_errors"] == 3 and st["misses"] == 6 and st["short_circuits"] == 0

    t0 = time.monotonic()  # open: answered without touching the network
    assert await s.put_many([(h(0), b"x")]) == 0
    assert await read_with(s, read, [h(0)]) == [None]
    assert await s.contains([h(0)]) == [False]
    await s.pin([h(0)])
    assert time.monotonic() - t0 < 0.05
    st = s.stats()
    assert st["short_circuits"] == 4 and st["skipped_writes"] == 1 and st["put_errors"] == 0
    # presence says which hashes the open breaker kept from being asked
    assert await s.presence([h(0), h(1)]) == Presence([False, False], [True, True])

    clock.advance(0.2)  # the probe runs and fails: still open, cooldown restarts
    assert await s.get_many([h(0)]) == [None]
    assert breaker.state == "open" and breaker.probe_failures == 1
    await s.close()


@pytest.mark.parametrize("read", ["get_many", "get_views", "stream_views"])
async def test_unresponsive_redis_times_out(read: str) -> None:
    """A server that accepts connections but never answers: each call ends at its deadline."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        breaker = CircuitBreaker(failure_threshold=2, cooldown_s=60.0)
        s = RedisStore.from_url(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, breaker=breaker)
        t0 = time.monotonic()
        assert await read_with(s, read, [h(0)]) == [None]
        assert time.monotonic() - t0 < 0.2 + 0.15
        assert breaker.consecutive_failures == 1
        t0 = time.monotonic()
        assert await s.put_many([(h(0), b"x")]) == 0
        assert time.monotonic() - t0 < 0.2 + 0.15
        assert breaker.state == "open"
        assert s.stats()["get_errors"] == 1 and s.stats()["put_errors"] == 1
        await s.close()


@pytest.mark.redis
async def test_oom_then_crash_then_restart(redis_server: RedisServer) -> None:
    raw = aioredis.from_url(redis_server.url)
    used = int((await raw.info("memory"))["used_memory"])
    await raw.config_set("maxmemory", used + (1 << 20))  # 1 MiB above what it holds now
    await raw.config_set("maxmemory-policy", "noeviction")
    await raw.aclose()

    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=0.2, clock=clock)
    s = RedisStore.from_url(redis_server.url, timeout_s=0.5, breaker=breaker, batch_size=4)

    # Full: writes beyond maxmemory are skipped and counted, never raised, breaker stays closed.
    block = 64 << 10
    written = 0
    for i in range(0, 40, 4):
        written += await s.put_many([(h(j), val(j, block)) for j in range(i, i + 4)])
    st = s.stats()
    assert 0 < written < 40
    assert st["skipped_writes"] == 40 - written == st["refused_writes"]
    assert st["put_errors"] == 0 and breaker.closed
    got = await s.get_many([h(j) for j in range(40)])  # reads still work
    assert sum(v is not None for v in got) == written
    assert got[0] == val(0, block)

    # Dead: misses, errors counted, breaker opens after 2 failures.
    redis_server.kill()
    assert await s.get_many([h(0)]) == [None]
    assert await s.put_many([(h(100), b"x")]) == 0
    assert breaker.state == "open"
    assert await s.get_many([h(0)]) == [None]
    assert s.stats()["short_circuits"] == 1

    # Back (empty, no persistence): before the cooldown still short-circuited; after it the probe
    # round-trips, the breaker closes and writes work again.
    redis_server.start()
    assert await s.put_many([(h(200), b"y")]) == 0
    assert breaker.state == "open"
    clock.advance(0.2)
    assert await s.put_many([(h(200), b"y")]) == 1
    assert breaker.closed and breaker.probes == 1 and breaker.probe_failures == 0
    assert await s.get_many([h(200), h(0)]) == [b"y", None]
    await s.close()


# -- Redis Cluster -------------------------------------------------------------------------------


async def test_dead_cluster_misses_fast_and_opens_breaker() -> None:
    """No startup node answers: the slot map cannot be had; misses, skipped writes, no raise."""
    clock = FakeClock()
    s = RedisClusterStore.from_url(
        f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}",
        timeout_s=0.3,
        breaker_factory=lambda: CircuitBreaker(failure_threshold=2, cooldown_s=0.2, clock=clock),
    )
    t0 = time.monotonic()
    assert await s.get_many([h(0), h(1)]) == [None, None]
    assert await s.put_many([(h(0), b"x")]) == 0
    assert await s.contains([h(0)]) == [False]
    await s.pin([h(0)])
    assert time.monotonic() - t0 < 4 * 0.3
    st = s.stats()
    assert (st["get_errors"], st["put_errors"], st["misses"]) == (1, 1, 2)
    assert st["breaker_state"] == "open" and st["short_circuits"] == 2
    assert await s.presence([h(0), h(1)]) == Presence([False, False], [True, True])
    clock.advance(0.2)  # the probe rediscovers nothing: still open
    assert await s.get_many([h(0)]) == [None]
    assert s.breaker.state == "open" and s.breaker.probe_failures == 1
    await s.close()


@pytest.fixture
async def cluster_ns(redis_cluster: RedisCluster) -> AsyncIterator[str]:
    ns = f"kvtest:{uuid.uuid4().hex}"
    yield ns
    await drop_cluster_namespace(redis_cluster, ns)


async def keys_per_node(cluster: RedisCluster, pattern: str) -> list[int]:
    counts = []
    for port in cluster.ports:
        client = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
        counts.append(len([k async for k in client.scan_iter(match=pattern)]))
        await client.aclose()
    return counts


@pytest.mark.redis
async def test_cluster_spreads_blocks_and_batches_per_master(
    redis_cluster: RedisCluster, cluster_ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = RedisClusterStore.from_url(f"{redis_cluster.url}/?namespace={cluster_ns}&timeout=1")
    items = [(h(i), val(i)) for i in range(64)]
    await s.put_many(items[:1])  # the first call discovers the slot map

    pipelines: list[tuple[str, int]] = []  # (node, commands) per round trip
    single: list[tuple[str, Any]] = []
    send_pipeline, send_command = ClusterNode.execute_pipeline, ClusterNode.execute_command

    async def count_pipeline(node: ClusterNode, commands: list[Any]) -> bool:
        pipelines.append((node.name, len(commands)))
        return await send_pipeline(node, commands)

    async def count_command(node: ClusterNode, *args: Any, **kwargs: Any) -> Any:
        single.append((node.name, args[0]))
        return await send_command(node, *args, **kwargs)

    monkeypatch.setattr(ClusterNode, "execute_pipeline", count_pipeline)
    monkeypatch.setattr(ClusterNode, "execute_command", count_command)
    masters = sorted(f"127.0.0.1:{p}" for p in redis_cluster.ports)

    assert await s.put_many(items) == 64
    counts = await keys_per_node(redis_cluster, f"{cluster_ns}:blk:*")
    assert sum(counts) == 64 and min(counts) > 0, counts  # no hash tags: every master holds some
    # One SMISMEMBER round trip to the pinned set's master, then one SET pipeline per master.
    assert len(pipelines) == 1 + 3 and sorted(n for n, _ in pipelines[1:]) == masters
    assert sum(c for _, c in pipelines[1:]) == 64

    pipelines.clear()
    assert await s.get_many([x for x, _ in items]) == [v for _, v in items]
    assert sorted(n for n, _ in pipelines) == masters and sum(c for _, c in pipelines) == 64
    assert single == []
    pipelines.clear()
    assert await s.contains([h(0), h(1000)]) == [True, False]
    await s.delete([x for x, _ in items])
    assert await keys_per_node(redis_cluster, f"{cluster_ns}:blk:*") == [0, 0, 0]
    assert single == [] and s.stats()["hits"] == 64
    await s.close()


async def wait_flagged_failed(cluster: RedisCluster, victim: int, observer: int) -> None:
    """Poll (deadline 10 s) until ``observer`` flags node ``victim`` as failed (FAIL, not PFAIL):
    the cluster itself has noticed, after ``cluster-node-timeout``."""
    client = aioredis.from_url(f"redis://127.0.0.1:{cluster.ports[observer]}/0")
    deadline = time.monotonic() + 10
    try:
        while True:
            nodes = await client.execute_command("CLUSTER NODES")
            flags = nodes[f"127.0.0.1:{cluster.ports[victim]}"]["flags"].split(",")
            if "fail" in flags:
                return
            assert time.monotonic() < deadline, "the cluster never flagged the node failed"
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_cluster_master_killed_then_restarted(
    redis_cluster: RedisCluster, cluster_ns: str
) -> None:
    """The master holding the pinned set dies (no replica): its keys are misses and its writes are
    skipped, never raised; only its breaker opens; the other masters keep serving, also once the
    cluster has flagged it failed. Restarted (empty), the probe closes its breaker."""
    clock = FakeClock()
    s = RedisClusterStore.from_url(
        f"{redis_cluster.url}/?namespace={cluster_ns}&ttl=100",
        timeout_s=0.5,
        breaker_factory=lambda: CircuitBreaker(failure_threshold=2, cooldown_s=0.2, clock=clock),
    )
    hashes = [h(i) for i in range(64)]
    owner = redis_cluster.nodes_of_keys([s.key(x) for x in hashes])
    victim = redis_cluster.node_of_key(s.pinned_set_key)
    victim_name = f"127.0.0.1:{redis_cluster.ports[victim]}"
    lost = [i for i in range(64) if owner[i] == victim]
    kept = [i for i in range(64) if owner[i] != victim]
    assert lost and kept
    assert await s.put_many([(x, val(i)) for i, x in enumerate(hashes)]) == 64
    await s.pin([hashes[kept[0]]])

    def expected(overrides: dict[int, bytes | None]) -> list[bytes | None]:
        return [overrides.get(i, None if owner[i] == victim else val(i)) for i in range(64)]

    redis_cluster.kill(victim)
    try:
        assert await s.get_many(hashes) == expected({})
        st = s.stats()
        assert st["get_errors"] == 1 and st["misses"] == len(lost)
        assert st["node_breakers"][victim_name] == "closed"
        # The pinned set is unreadable: the block on a live master is written with the TTL (its
        # pin is unknown), the one on the dead master is skipped; the second failure opens.
        assert await s.put_many([(hashes[kept[0]], b"new"), (hashes[lost[0]], b"new")]) == 1
        owner_client = aioredis.from_url(f"redis://127.0.0.1:{redis_cluster.ports[owner[kept[0]]]}")
        assert 0 < await owner_client.ttl(s.key(hashes[kept[0]])) <= 100
        await owner_client.aclose()
        st = s.stats()
        assert st["put_errors"] == 1 and st["node_breakers"][victim_name] == "open"
        assert [b for n, b in st["node_breakers"].items() if n != victim_name] == ["closed"] * 2

        # Open: the dead master is not called, the others answer within one round trip.
        t0 = time.monotonic()
        assert await s.get_many(hashes) == expected({kept[0]: b"new"})
        assert time.monotonic() - t0 < 0.5  # no deadline waited for the dead master
        assert await s.put_many([(hashes[lost[1]], b"x"), (hashes[kept[1]], b"x")]) == 1
        assert s.stats()["skipped_writes"] == 1 and s.stats()["short_circuits"] == 2
        # The dead master's hashes are not asked about (its breaker); the others are answered.
        p = await s.presence(hashes)
        assert p.short_circuited == [owner[i] == victim for i in range(64)]
        assert p.stored == [owner[i] != victim for i in range(64)]
        assert s.stats()["short_circuits"] == 3

        # Once the cluster flags the master failed, the survivors still serve (the servers run
        # with cluster-require-full-coverage no).
        await wait_flagged_failed(redis_cluster, victim, observer=(victim + 1) % 3)
        assert await s.get_many(hashes) == expected({kept[0]: b"new", kept[1]: b"x"})
        assert s.stats()["other_errors"] == 0
    finally:
        redis_cluster.restart(victim)  # the shared cluster must be whole for later tests

    # Back, empty. Before the cooldown still short-circuited; after it the probe round-trips on
    # that master and its breaker closes; its blocks and the pins it held are gone.
    assert await s.get_many([hashes[lost[0]]]) == [None]
    assert s.stats()["short_circuits"] == 5
    clock.advance(0.2)
    got = await s.get_many(hashes)
    assert got == expected({kept[0]: b"new", kept[1]: b"x"})
    st = s.stats()
    assert st["breaker_state"] == "closed" and st["breaker_probes"] == 1
    assert st["breaker_probe_failures"] == 0
    assert await s.put_many([(hashes[i], val(i)) for i in lost]) == len(lost)
    assert await s.get_many([hashes[i] for i in lost]) == [val(i) for i in lost]
    raw = AsyncRedisCluster.from_url(f"redis://127.0.0.1:{redis_cluster.ports[victim]}")
    assert await raw.smembers(s.pinned_set_key) == set()
    await raw.aclose()
    await s.close()
