"""Contract tests shared by every BlockStore backend, plus the Redis failure policy (timeouts,
circuit breaker, OOM refusals, restart) against Redis servers the tests start themselves."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from kvserve.shared.store.base import BlockStore, open_store, parse_size
from kvserve.shared.store.breaker import CircuitBreaker
from kvserve.shared.store.disk import DiskStore
from kvserve.shared.store.hashing import BlockHash
from kvserve.shared.store.memory import MemoryStore
from kvserve.shared.store.redis import RedisStore

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def redis_answers(url: str) -> bool:
    client = aioredis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(await client.ping())
    except Exception:
        return False
    finally:
        await client.aclose()


async def drop_namespace(url: str, namespace: str) -> None:
    client = aioredis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{namespace}:*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


# -- backends under one contract ----------------------------------------------------------------


@pytest.fixture(params=["memory", "file", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BlockStore]:
    if request.param == "memory":
        s: BlockStore = open_store("memory://?max_bytes=1m")
    elif request.param == "file":
        s = open_store(f"file://{tmp_path}/blocks?max_bytes=1m")
    else:
        if not await redis_answers(LOCAL_REDIS):
            pytest.skip("no Redis at 127.0.0.1:6379")
        ns = f"kvtest:{uuid.uuid4().hex}"
        s = open_store(f"{LOCAL_REDIS}?ttl=100&timeout=1&namespace={ns}")
    yield s
    if isinstance(s, RedisStore):
        await drop_namespace(LOCAL_REDIS, s.namespace)
    await s.close()


async def test_round_trip(store: BlockStore) -> None:
    items = [(h(i), val(i)) for i in range(5)]
    assert await store.put_many(items) == 5
    assert await store.get_many([h(0), h(99), h(4)]) == [val(0), None, val(4)]
    assert await store.contains([h(1), h(99)]) == [True, False]
    await store.delete([h(1), h(99)])
    assert await store.get_many([h(1), h(2)]) == [None, val(2)]
    assert await store.contains([h(1)]) == [False]
    assert await store.get_many([]) == []
    assert await store.put_many([]) == 0
    st = store.stats()
    assert st["hits"] == 3 and st["misses"] == 2 and st["puts"] == 5
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
    with pytest.raises(ValueError):
        open_store("ftp://x")
    with pytest.raises(ValueError):
        open_store("file://relative/dir")


# -- Redis TTL and pins -------------------------------------------------------------------------


@pytest.mark.redis
async def test_redis_ttl_on_unpinned_removed_on_pin() -> None:
    if not await redis_answers(LOCAL_REDIS):
        pytest.skip("no Redis at 127.0.0.1:6379")
    ns = f"kvtest:{uuid.uuid4().hex}"
    s = RedisStore.from_url(f"{LOCAL_REDIS}?ttl=100", namespace=ns)
    raw = aioredis.from_url(LOCAL_REDIS)
    try:
        await s.put_many([(h(0), b"a"), (h(1), b"b")])
        assert 0 < await raw.ttl(s.key(h(0))) <= 100
        await s.pin([h(0), h(2)])
        assert await raw.ttl(s.key(h(0))) == -1
        assert await raw.smembers(s.pinned_set_key) == {h(0).hex().encode(), h(2).hex().encode()}
        await s.put_many([(h(0), b"a2"), (h(2), b"c")])  # pinned keys are written without TTL
        assert await raw.ttl(s.key(h(0))) == -1 and await raw.ttl(s.key(h(2))) == -1
        await s.unpin([h(0)])
        assert 0 < await raw.ttl(s.key(h(0))) <= 100
        await s.delete([h(2)])
        assert await raw.smembers(s.pinned_set_key) == set()
        assert await raw.exists(s.key(h(2))) == 0
    finally:
        await drop_namespace(LOCAL_REDIS, ns)
        await raw.aclose()
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


async def test_dead_redis_misses_fast_and_opens_breaker() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=0.2, clock=clock)
    s = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.3, breaker=breaker)
    for i in range(3):
        t0 = time.monotonic()
        assert await s.get_many([h(i), h(i + 1)]) == [None, None]
        assert time.monotonic() - t0 < 0.3 + 0.2
    assert breaker.state == "open"
    st = s.stats()
    assert st["get_errors"] == 3 and st["misses"] == 6 and st["short_circuits"] == 0

    t0 = time.monotonic()  # open: answered without touching the network
    assert await s.put_many([(h(0), b"x")]) == 0
    assert await s.get_many([h(0)]) == [None]
    assert await s.contains([h(0)]) == [False]
    await s.pin([h(0)])
    assert time.monotonic() - t0 < 0.05
    st = s.stats()
    assert st["short_circuits"] == 4 and st["skipped_writes"] == 1 and st["put_errors"] == 0

    clock.advance(0.2)  # the probe runs and fails: still open, cooldown restarts
    assert await s.get_many([h(0)]) == [None]
    assert breaker.state == "open" and breaker.probe_failures == 1
    await s.close()


async def test_unresponsive_redis_times_out() -> None:
    """A server that accepts connections but never answers: each call ends at its deadline."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        breaker = CircuitBreaker(failure_threshold=2, cooldown_s=60.0)
        s = RedisStore.from_url(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, breaker=breaker)
        t0 = time.monotonic()
        assert await s.get_many([h(0)]) == [None]
        assert time.monotonic() - t0 < 0.2 + 0.15
        assert breaker.consecutive_failures == 1
        t0 = time.monotonic()
        assert await s.put_many([(h(0), b"x")]) == 0
        assert time.monotonic() - t0 < 0.2 + 0.15
        assert breaker.state == "open"
        assert s.stats()["get_errors"] == 1 and s.stats()["put_errors"] == 1
        await s.close()


class RedisServer:
    """A redis-server subprocess on a fixed port, without persistence."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir)]
        self.proc = subprocess.Popen(
            [exe, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not await redis_answers(self.url):  # readiness poll, not a timing assumption
            assert self.proc.poll() is None, "redis-server exited"
            assert time.monotonic() < deadline, "redis-server did not come up"
            await asyncio.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    server = RedisServer(free_port(), tmp_path)
    yield server
    server.kill()


@pytest.mark.redis
async def test_oom_then_crash_then_restart(redis_server: RedisServer) -> None:
    await redis_server.start()
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
    await redis_server.start()
    assert await s.put_many([(h(200), b"y")]) == 0
    assert breaker.state == "open"
    clock.advance(0.2)
    assert await s.put_many([(h(200), b"y")]) == 1
    assert breaker.closed and breaker.probes == 1 and breaker.probe_failures == 0
    assert await s.get_many([h(200), h(0)]) == [b"y", None]
    await s.close()
