"""Both bus implementations behind one interface; the Redis Streams one also for what only it
has (consumer groups, claiming a dead worker's requests, poison messages), against the real
Redis (marker `redis`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from kvserve.services.bench.lib.process import free_port
from kvserve.services.bench.lib.redis_server import redis_answers
from kvserve.shared.bus.base import Bus, BusUnavailableError
from kvserve.shared.bus.memory import InProcessBus
from kvserve.shared.bus.redis import RedisBus
from kvserve.shared.bus.redis_layout import RedisBusConfig
from kvserve.shared.protocol import Cancel, ErrorInfo, GenerateRequest, TokenEvent
from kvserve.shared.sampling_params import SamplingParams

REDIS_URL = "redis://127.0.0.1:6379/13"


async def make_redis_bus(**config: Any) -> RedisBus:
    if not await redis_answers(REDIS_URL):
        pytest.skip(f"no Redis at {REDIS_URL}")
    prefix = f"kvtest-{uuid.uuid4().hex[:12]}"
    return RedisBus(REDIS_URL, RedisBusConfig(prefix=prefix, **config))


async def drop(bus: RedisBus) -> None:
    keys = [k async for k in bus.redis.scan_iter(match=f"{bus.config.prefix}:*")]
    if keys:
        await bus.redis.delete(*keys)
    await bus.close()


@pytest.fixture(params=["inproc", pytest.param("redis", marks=pytest.mark.redis)])
async def bus(request: pytest.FixtureRequest) -> AsyncIterator[Bus]:
    if request.param == "inproc":
        yield InProcessBus()
        return
    b = await make_redis_bus()
    try:
        yield b
    finally:
        await drop(b)


@pytest.fixture
async def rbus() -> AsyncIterator[RedisBus]:
    b = await make_redis_bus(claim_idle_s=0.0, max_deliveries=3)
    try:
        yield b
    finally:
        await drop(b)


def request(rid: str = "r1", n: int = 1) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4, n=n), cache_salt="t")


def event(seq: int, index: int = 0, finish: str | None = None, rid: str = "r1") -> TokenEvent:
    return TokenEvent(rid, seq, index, [100 + seq], f"t{seq}", finish_reason=finish)


# ---- both implementations --------------------------------------------------------------------


async def test_events_deduplicated_in_seq_order_until_every_completion_ends(bus: Bus) -> None:
    port = bus.worker("w1")
    await port.start()
    sent = request(n=2)
    stream = await bus.submit(sent)
    (d,) = await port.receive(timeout=5)
    assert d.request == sent and not d.redelivered
    for ev in [event(0), event(0), event(2, 1, "length"), event(1, 0, "stop"), event(1)]:
        await port.emit(ev)  # a duplicate, a gap filled late, a duplicate after the end
    got = [ev async for ev in stream]
    assert [(e.seq, e.index, e.finish_reason) for e in got] == [
        (0, 0, None),
        (1, 0, "stop"),
        (2, 1, "length"),
    ]
    assert stream.done
    await port.ack(d)
    await stream.close()
    await port.close()


async def test_error_event_ends_the_stream_whatever_its_seq(bus: Bus) -> None:
    port = bus.worker()
    await port.start()
    stream = await bus.submit(request())
    await port.receive(timeout=5)
    await port.emit(event(0))
    await port.emit(TokenEvent("r1", 7, error=ErrorInfo("boom", "server_error")))
    got = [ev async for ev in stream]
    assert [e.seq for e in got] == [0, 7] and got[-1].error == ErrorInfo("boom", "server_error")
    await stream.close()
    await port.close()


async def test_cancel_reaches_every_worker(bus: Bus) -> None:
    a, b = bus.worker("a"), bus.worker("b")
    await a.start()
    await b.start()
    await bus.cancel("r1", "client")
    assert await a.cancels(timeout=5) == [Cancel("r1", "client")]
    assert await b.cancels(timeout=5) == [Cancel("r1", "client")]
    assert await a.is_cancelled("r1") and not await a.is_cancelled("r2")
    assert await a.cancels(timeout=0.01) == []
    await a.close()
    await b.close()


async def test_ready_and_stats_follow_live_workers(bus: Bus) -> None:
    assert not await bus.ready()
    port = bus.worker("w1")
    await port.start(lambda: {"num_requests_running": 2})
    assert await bus.ready()
    stats = await bus.stats()
    assert list(stats) == ["w1"] and stats["w1"]["num_requests_running"] == 2
    await port.close()
    assert not await bus.ready()
    assert await bus.stats() == {}


async def test_ready_raises_when_redis_is_unreachable() -> None:
    bus = RedisBus(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    with pytest.raises(BusUnavailableError, match="Redis is unreachable"):
        await bus.ready()
    await bus.close()


async def test_receive_times_out_empty(bus: Bus) -> None:
    port = bus.worker()
    await port.start()
    assert await port.receive(timeout=0.01) == []
    await port.close()


# ---- Redis Streams only ----------------------------------------------------------------------


@pytest.mark.redis
async def test_dead_workers_request_is_claimed_and_completes(rbus: RedisBus) -> None:
    stream = await rbus.submit(request())
    dead = rbus.worker("dead")
    await dead.start()
    (first,) = await dead.receive(timeout=5)
    await dead.emit(event(0))  # it got this far, then died (no ack, no heartbeat)
    await dead.close()
    live = rbus.worker("live")
    await live.start()
    (again,) = await live.receive(timeout=5)
    assert again.redelivered and again.request == first.request
    await live.emit(event(0))  # re-run from the start: the duplicate is dropped
    await live.emit(event(1, 0, "stop"))
    await live.ack(again)
    assert [e.seq for e in [ev async for ev in stream]] == [0, 1]
    assert (await rbus.redis.xpending(rbus.keys.request_key, "prefill"))["pending"] == 0
    assert await rbus.redis.xlen(rbus.keys.request_key) == 0
    await stream.close()
    assert not await rbus.redis.exists(rbus.keys.out_key("r1"))
    await live.close()


@pytest.mark.redis
async def test_heartbeat_keeps_held_requests_fresh() -> None:
    bus = await make_redis_bus(claim_idle_s=30.0)
    try:
        port = bus.worker("w")
        await port.start()
        await bus.submit(request())
        (d,) = await port.receive(timeout=5)

        async def pending() -> dict[str, Any]:
            rows = await bus.redis.xpending_range(bus.keys.request_key, "prefill", "-", "+", 1)
            return dict(rows[0])

        deadline = time.monotonic() + 5
        while (await pending())["time_since_delivered"] < 200:  # let it go idle a little
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await port.heartbeat()  # type: ignore[attr-defined]
        after = await pending()
        assert after["time_since_delivered"] < 200 and after["times_delivered"] == 1
        # A second worker does not take a request whose worker is alive.
        other = bus.worker("other")
        await other.start()
        assert await other.receive(timeout=0.05) == []
        await port.ack(d)
        await other.close()
        await port.close()
    finally:
        await drop(bus)


@pytest.mark.redis
async def test_poison_request_fails_after_max_deliveries() -> None:
    bus = await make_redis_bus(claim_idle_s=0.0, max_deliveries=1)
    try:
        stream = await bus.submit(request())
        a = bus.worker("a")
        await a.start()
        await a.receive(timeout=5)  # delivery 1; a dies with it
        await a.close()
        b = bus.worker("b")
        await b.start()
        assert await b.receive(timeout=0.05) == []  # delivery 2 > max: failed, not run
        (err,) = [ev async for ev in stream]
        assert err.error is not None and err.error.code == "quarantined"
        assert b.quarantined == 1
        assert (await bus.redis.xpending(bus.keys.request_key, "prefill"))["pending"] == 0
        await b.close()
    finally:
        await drop(bus)


@pytest.mark.redis
async def test_malformed_request_is_acked_and_dropped(rbus: RedisBus) -> None:
    port = rbus.worker("w")
    await port.start()
    await rbus.redis.xadd(rbus.keys.request_key, {b"m": b"\xc1 not msgpack"})
    await rbus.submit(request("good"))
    got = await port.receive(timeout=5)
    while not got:
        got = await port.receive(timeout=5)
    assert [d.request.request_id for d in got] == ["good"]
    await port.ack(got[0])
    assert (await rbus.redis.xpending(rbus.keys.request_key, "prefill"))["pending"] == 0
    await port.close()


@pytest.mark.redis
async def test_cancel_before_pickup_is_remembered(rbus: RedisBus) -> None:
    await rbus.submit(request())
    await rbus.cancel("r1", "deadline")
    port = rbus.worker("late")
    await port.start()  # reads cancels from now on; the earlier one is in the cancelled key
    assert await port.cancels(timeout=0.01) == []
    assert await port.is_cancelled("r1")
    await port.close()


@pytest.mark.redis
async def test_event_stream_outlasts_a_redis_stall_longer_than_redis_pys_timeout(
    redis_server: Any,
) -> None:
    """A Redis that answers nothing for 6.5 s (CLIENT PAUSE, as on a saturated host) is not down:
    the gateway's read resumes and the request completes (redis-py 8 alone gives up at 5 s)."""
    bus = RedisBus(redis_server.url, RedisBusConfig(prefix="stall"))
    port = bus.worker("w1")
    await port.start()
    stream = await bus.submit(request())
    (d,) = await port.receive(timeout=5)
    reader = asyncio.create_task(anext(aiter(stream)))
    admin = aioredis.Redis.from_url(redis_server.url)
    await admin.execute_command("CLIENT", "PAUSE", 6500, "ALL")
    await port.emit(event(0, 0, "stop"))  # held by the pause like every other command
    got = await reader
    assert (got.seq, got.finish_reason) == (0, "stop")
    await port.ack(d)
    await stream.close()
    await port.close()
    await bus.close()


async def wait_for_blocked_clients(admin: Any, n: int) -> int:
    deadline = time.monotonic() + 30
    while (blocked := (await admin.info("clients"))["blocked_clients"]) < n:
        assert time.monotonic() < deadline, f"never {n} blocked clients"
        await asyncio.sleep(0.01)
    return int(blocked)


@pytest.mark.redis
async def test_every_stream_in_flight_waits_on_one_connection(redis_server: Any) -> None:
    """150 requests in flight at a gateway wait for their events in one XREAD, on a pool of 8
    connections, and all complete. (Each stream used to wait in an XREAD of its own: a
    connection per request in flight, and redis-py's default pool of 100 ran out.)"""
    bus = RedisBus(redis_server.url, RedisBusConfig(prefix="pool", max_connections=8))
    workers = RedisBus(redis_server.url, RedisBusConfig(prefix="pool"))  # another process's
    port = workers.worker("w1")
    await port.start()
    rids = [f"r{i}" for i in range(150)]
    streams = [await bus.submit(request(rid)) for rid in rids]
    readers = [asyncio.create_task(anext(aiter(s))) for s in streams]
    admin = aioredis.Redis.from_url(redis_server.url)
    assert await wait_for_blocked_clients(admin, 1) == 1
    assert await bus.ready()
    got: list[Any] = []
    while len(got) < len(rids):
        got += await port.receive(max_count=64, timeout=1)
    for d in got:
        await port.emit(event(0, 0, "stop", rid=d.request.request_id))
        await port.ack(d)
    finished = await asyncio.wait_for(asyncio.gather(*readers), 60)
    assert [(e.request_id, e.finish_reason) for e in finished] == [(r, "stop") for r in rids]
    for s in streams:
        await s.close()
    await port.close()
    await admin.aclose()
    await workers.close()
    await bus.close()


@pytest.mark.redis
async def test_a_new_request_wakes_the_waiting_read(redis_server: Any) -> None:
    """With one request's read blocked for up to 20 s, a second request's events still arrive
    at once: its submit wakes the read, which then includes its stream."""
    bus = RedisBus(redis_server.url, RedisBusConfig(prefix="wake", read_block_ms=20_000))
    port = bus.worker("w1")
    await port.start()
    admin = aioredis.Redis.from_url(redis_server.url)
    first = await bus.submit(request("r1"))
    first_reader = asyncio.create_task(anext(aiter(first)))
    (d1,) = await port.receive(timeout=5)
    await wait_for_blocked_clients(admin, 1)
    second = await bus.submit(request("r2"))
    (d2,) = await port.receive(timeout=5)
    await port.emit(event(0, 0, "stop", rid="r2"))
    got = await asyncio.wait_for(anext(aiter(second)), 10)
    assert (got.request_id, got.finish_reason) == ("r2", "stop")
    await port.emit(event(0, 0, "stop", rid="r1"))
    assert (await asyncio.wait_for(first_reader, 10)).request_id == "r1"
    for d in (d1, d2):
        await port.ack(d)
    await first.close()
    await second.close()
    await port.close()
    await admin.aclose()
    await bus.close()


@pytest.mark.redis
async def test_closing_the_bus_ends_the_streams_still_open(rbus: RedisBus) -> None:
    stream = await rbus.submit(request("r1"))
    reader = asyncio.create_task(anext(aiter(stream)))
    await rbus.reader.close()
    with pytest.raises(BusUnavailableError):
        await asyncio.wait_for(reader, 10)
    with pytest.raises(BusUnavailableError):
        await rbus.submit(request("r2"))


@pytest.mark.redis
async def test_a_failed_read_fails_every_open_stream(redis_server: Any) -> None:
    """Redis gone while requests wait: each stream raises the error (the gateway request
    fails) instead of waiting forever, and the bus recovers for new requests once it is back."""
    bus = RedisBus(redis_server.url, RedisBusConfig(prefix="down", socket_timeout_s=2))
    streams = [await bus.submit(request(f"r{i}")) for i in range(3)]
    readers = [asyncio.create_task(anext(aiter(s))) for s in streams]
    admin = aioredis.Redis.from_url(redis_server.url)
    await wait_for_blocked_clients(admin, 1)
    await admin.aclose()
    redis_server.kill()
    results = await asyncio.wait_for(asyncio.gather(*readers, return_exceptions=True), 60)
    assert all(isinstance(r, Exception) for r in results), results
    for s in streams:
        await s.close()
    redis_server.restart()
    port = bus.worker("w1")
    await port.start()
    stream = await bus.submit(request("r9"))
    (d,) = await port.receive(timeout=5)
    await port.emit(event(0, 0, "stop", rid="r9"))
    assert (await asyncio.wait_for(anext(aiter(stream)), 10)).request_id == "r9"
    await port.ack(d)
    await stream.close()
    await port.close()
    await bus.close()


async def test_send_queues_without_listening(bus: Bus) -> None:
    """What a prefill worker forwards is read by the gateway that submitted it: `send` leaves
    no event stream behind on the forwarding side."""
    await bus.send(request("fwd"))
    port = bus.worker("w")
    await port.start()
    got = await port.receive(timeout=5)
    while not got:
        got = await port.receive(timeout=5)
    assert [d.request.request_id for d in got] == ["fwd"]
    if isinstance(bus, RedisBus):
        assert not bus.reader._open
    await port.ack(got[0])
    await port.close()


async def test_a_group_that_cannot_be_created_is_an_error_not_a_spin(redis_server: Any) -> None:
    """The group went away (its stream evicted, or Redis restarted empty) and the bus refuses
    writes: the read says so (the worker's receive loop then backs off) instead of returning
    nothing at once, again and again."""
    from redis.exceptions import OutOfMemoryError

    bus = RedisBus(redis_server.url, RedisBusConfig(prefix="kvtest-oom"))
    port = bus.worker("w")
    await port.start()
    try:
        await bus.redis.delete(bus.keys.request_key, port.own_key)  # type: ignore[attr-defined]
        await bus.redis.config_set("maxmemory-policy", "noeviction")
        await bus.redis.config_set("maxmemory", "1")
        try:
            with pytest.raises(OutOfMemoryError):
                await port.receive(timeout=0.05)
        finally:
            await bus.redis.config_set("maxmemory", "0")
        assert await port.receive(timeout=0.05) == []  # the group is created again
        groups = await bus.redis.xinfo_groups(bus.keys.request_key)
        assert [g["name"] for g in groups] == [b"prefill"]
    finally:
        await port.close()
        await bus.close()
