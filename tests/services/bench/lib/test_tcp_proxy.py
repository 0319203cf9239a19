"""services/bench/lib/tcp_proxy.py: forwarding, delay, cut, black hole, half-close and shutdown,
through the proxy to the shared Redis on 127.0.0.1:6379 (db 15) with redis-py.

Clients never retry (`NO_RETRY`), so a fault the proxy injects is the error the test sees. The
only timing assertion is a lower bound that follows from a delay the test sets."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from kvserve.services.bench.lib.process import free_port
from kvserve.services.bench.lib.redis_server import redis_answers
from kvserve.services.bench.lib.tcp_proxy import FaultProxy, ThreadedFaultProxy
from redis.backoff import NoBackoff
from redis.retry import Retry

pytestmark = pytest.mark.redis

REDIS_HOST, REDIS_PORT, REDIS_DB = "127.0.0.1", 6379, 15
NO_RETRY = Retry(NoBackoff(), 0)
DEADLINE_S = 5.0


@pytest.fixture(scope="module", autouse=True)
def local_redis() -> None:
    if not asyncio.run(redis_answers(f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}")):
        pytest.skip("no Redis at 127.0.0.1:6379")


@pytest.fixture
def proxy() -> Iterator[ThreadedFaultProxy]:
    with ThreadedFaultProxy(REDIS_HOST, REDIS_PORT) as p:
        yield p


def client(port: int, socket_timeout: float = 5.0) -> redis.Redis:
    """A client on one connection of its own, without retries: a failure is not papered over."""
    timeouts = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout}
    return redis.Redis(
        "127.0.0.1", port, REDIS_DB, single_connection_client=True, retry=NO_RETRY, **timeouts
    )


def wait_until(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.01)


def test_ping_set_get_through_the_proxy(proxy: ThreadedFaultProxy) -> None:
    key = f"kvtest:proxy:{uuid.uuid4().hex}"
    with client(proxy.port) as r:
        assert r.ping() is True
        assert r.set(key, b"value", ex=60) is True
        assert r.get(key) == b"value"
        assert r.delete(key) == 1
        stats = proxy.stats()
    assert stats.accepted == 1
    assert stats.open == 1
    assert stats.cut == 0
    assert stats.bytes_to_target > 0
    assert stats.bytes_to_client > 0


def test_delay_holds_each_chunk_and_keeps_order(proxy: ThreadedFaultProxy) -> None:
    key = f"kvtest:proxy:{uuid.uuid4().hex}"
    with client(proxy.port) as r:
        # Connected before the delay (the pipeline takes a pooled connection of its own): the
        # handshakes are not what is measured.
        r.ping()
        r.pipeline(transaction=False).ping().execute()
        proxy.set_delay(0.2)
        t0 = time.monotonic()
        assert r.ping() is True
        # The request and the reply each wait 0.2 s.
        assert time.monotonic() - t0 >= 0.4
        pipe = r.pipeline(transaction=False)
        for i in range(200):
            pipe.rpush(key, i)
        pipe.lrange(key, 0, -1)
        pipe.delete(key)
        *pushed, listed, deleted = pipe.execute()
        assert pushed == list(range(1, 201))
        assert listed == [str(i).encode() for i in range(200)]
        assert deleted == 1
        proxy.set_delay(0)
        assert r.ping() is True


def test_set_delay_rejects_negative(proxy: ThreadedFaultProxy) -> None:
    with pytest.raises(ValueError):
        proxy.set_delay(-1.0)
    with pytest.raises(ValueError):
        proxy.set_delay(float("nan"))


def test_cut_closes_open_connections_and_new_ones_work(proxy: ThreadedFaultProxy) -> None:
    old = client(proxy.port)
    assert old.ping() is True
    assert proxy.cut() == 1
    assert proxy.stats().open == 0
    with pytest.raises(redis.ConnectionError):
        old.ping()
    old.close()
    with client(proxy.port) as new:
        assert new.ping() is True
    stats = proxy.stats()
    assert stats.accepted == 2
    assert stats.cut == 1


def test_blackhole_stalls_then_closes_and_recovers(proxy: ThreadedFaultProxy) -> None:
    before = client(proxy.port, socket_timeout=0.5)
    assert before.ping() is True
    proxy.set_blackhole(True)
    sent = proxy.stats().bytes_to_target
    with pytest.raises(redis.TimeoutError):
        client(proxy.port, socket_timeout=0.5).ping()  # accepted, never answered
    stats = proxy.stats()
    assert stats.accepted == 2
    assert stats.open == 2
    assert stats.bytes_to_target == sent  # nothing forwarded

    proxy.set_blackhole(False)
    stats = proxy.stats()
    assert stats.open == 0  # the stalled links are closed: their peers must reconnect
    assert stats.cut == 2
    with pytest.raises(redis.ConnectionError):
        before.ping()
    before.close()
    with client(proxy.port) as fresh:
        assert fresh.ping() is True


def test_an_error_on_one_link_leaves_the_others(proxy: ThreadedFaultProxy) -> None:
    with client(proxy.port) as r:
        assert r.ping() is True
        s = socket.create_connection(("127.0.0.1", proxy.port))
        s.sendall(b"*1\r\n$4\r\nPI")  # half a command, then a reset
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
        wait_until(lambda: proxy.stats().open == 1)
        assert r.ping() is True


def test_unreachable_target_closes_the_client_only() -> None:
    with ThreadedFaultProxy("127.0.0.1", free_port()) as p:
        with pytest.raises(redis.ConnectionError):
            client(p.port).ping()
        wait_until(lambda: p.stats().open == 0)
        assert p.stats().accepted == 1


def test_half_close_is_forwarded_both_ways() -> None:
    """The client shuts its write half; the target sees end of stream, still answers, then
    shuts its own; the client reads the answer, then end of stream."""

    async def run() -> None:
        async def reply_after_eof(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            data = await r.read()  # until the client's end of stream
            w.write(data[::-1])
            w.write_eof()
            await w.drain()
            w.close()

        target = await asyncio.start_server(reply_after_eof, "127.0.0.1", 0)
        async with target, FaultProxy("127.0.0.1", target.sockets[0].getsockname()[1]) as p:
            reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
            writer.write(b"abc")
            writer.write(b"def")
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), DEADLINE_S) == b"fedcba"
            writer.close()
            await writer.wait_closed()

    asyncio.run(run())


def test_threaded_close_leaves_nothing_open() -> None:
    p = ThreadedFaultProxy(REDIS_HOST, REDIS_PORT)
    p.start()
    port = p.port
    r = client(port)
    assert r.ping() is True
    p.close()
    assert p.stats().open == 0
    with pytest.raises(redis.ConnectionError):
        r.ping()
    r.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    p.close()  # idempotent


async def test_close_cancels_every_task_and_closes_every_link() -> None:
    p = FaultProxy(REDIS_HOST, REDIS_PORT)
    await p.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    writer.write(b"PING\r\n")
    assert await reader.readline() == b"+PONG\r\n"
    await p.set_blackhole(True)
    stalled = await asyncio.open_connection("127.0.0.1", p.port)
    while p.stats().accepted < 2:
        await asyncio.sleep(0.01)
    assert p.stats().open == 2

    await p.close()
    assert p.stats().open == 0
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert await asyncio.wait_for(reader.read(), DEADLINE_S) == b""
    assert await asyncio.wait_for(stalled[0].read(), DEADLINE_S) == b""
    for w in (writer, stalled[1]):
        w.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", p.port)
