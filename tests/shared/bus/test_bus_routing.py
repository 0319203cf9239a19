"""The Redis bus's routing side against the real Redis (marker `redis`): a request routed to a
worker's own stream reaches that worker only; a dead worker's stream is adopted (what it never
read, and what it held); a worker describes itself and publishes KV events; a bus whose keys
vanished (Redis restarted empty) recovers its consumer groups and registrations by itself."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kvserve.shared.bus.base import Delivery, WorkerPort
from kvserve.shared.bus.redis import RedisBus
from kvserve.shared.protocol import KVEvent, WorkerInfo

from tests.shared.bus.test_bus import drop, make_redis_bus, request

pytestmark = pytest.mark.redis

DEADLINE_S = 10.0


@pytest.fixture
async def rbus() -> AsyncIterator[RedisBus]:
    # No heartbeat after start (a worker is dead 0.3 s after it stops beating); claims at once.
    b = await make_redis_bus(heartbeat_s=60.0, worker_ttl_s=0.3, claim_idle_s=0.0)
    try:
        yield b
    finally:
        await drop(b)


def info(name: str) -> WorkerInfo:
    return WorkerInfo(name, "worker", f"inc-{name}", 16, "m", "t", "float32", "redis://h/0", 1.0)


async def started(bus: RedisBus, name: str) -> WorkerPort:
    port = bus.worker(name)
    await port.start(lambda: {"num_used_blocks": 1}, info(name))
    return port


async def receive_until(port: WorkerPort, n: int = 1) -> list[Delivery]:
    """Receive until `n` deliveries came (each receive waits at most 0.1 s for one)."""
    out: list[Delivery] = []
    deadline = time.monotonic() + DEADLINE_S
    while len(out) < n and time.monotonic() < deadline:
        port._last_claim = 0.0  # type: ignore[attr-defined]  # claim on every call, not per beat
        out += await port.receive(16, timeout=0.1)
    return out


async def wait_dead(bus: RedisBus, name: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while name not in await bus.dead_workers():
        assert time.monotonic() < deadline, f"{name} never scored dead"
        await bus.redis.ping()  # a round trip, not a sleep: the TTL passes meanwhile


@pytest.fixture
async def live_bus() -> AsyncIterator[RedisBus]:
    """Workers stay alive for the whole test (no heartbeat needed)."""
    b = await make_redis_bus(heartbeat_s=60.0, worker_ttl_s=60.0)
    try:
        yield b
    finally:
        await drop(b)


async def test_a_routed_request_reaches_only_its_worker(live_bus: RedisBus) -> None:
    rbus = live_bus
    a, b = await started(rbus, "a"), await started(rbus, "b")
    stream = await rbus.submit(request("r1"), worker="b")
    assert await a.receive(16, timeout=0.2) == []
    got = await receive_until(b)
    assert [d.request.request_id for d in got] == ["r1"] and got[0].stream == rbus.keys.to_key("b")
    await b.ack(got[0])
    assert await rbus.redis.xlen(rbus.keys.to_key("b")) == 0
    await stream.close()
    assert set(await rbus.workers()) == {"a", "b"}
    assert (await rbus.workers())["b"] == info("b")
    await a.close()
    await b.close()
    assert await rbus.workers() == {}  # closed workers score themselves dead


async def test_a_dead_workers_unread_and_held_requests_are_adopted(rbus: RedisBus) -> None:
    a = await started(rbus, "a")
    await rbus.submit(request("held"), worker="a")
    held = await receive_until(a)  # delivered to a, never acked
    await rbus.submit(request("unread"), worker="a")
    await a.close()
    b = await started(rbus, "b")
    await wait_dead(rbus, "a")
    got = await receive_until(b, 2)
    by_id = {d.request.request_id: d for d in got}
    assert set(by_id) == {"held", "unread"} and held[0].request.request_id == "held"
    assert by_id["held"].redelivered and not by_id["unread"].redelivered
    for d in got:
        assert d.stream == rbus.keys.to_key("a")
        await b.ack(d)
    await receive_until(b, 0)
    b._last_claim = 0.0  # type: ignore[attr-defined]
    await b.receive(16, timeout=0.1)  # the empty stream of a dead worker: its registration goes
    assert await rbus.redis.zscore(rbus.keys.workers_key, "a") is None
    assert not await rbus.redis.exists(rbus.keys.to_key("a"))
    assert await rbus.redis.hget(rbus.keys.info_key, "a") is None
    await b.close()


async def test_kv_events_are_read_once_in_order(rbus: RedisBus) -> None:
    a = await started(rbus, "a")
    first = [KVEvent("a", "inc-a", s, "stored", "device", [bytes([s]) * 32]) for s in range(3)]
    await a.publish_kv_events(first)
    assert await rbus.kv_events(block_ms=100) == first
    later = [KVEvent("a", "inc-a", 3, "cleared")]
    before = time.time()
    await a.publish_kv_events(later)
    assert await rbus.kv_events(block_ms=100) == later
    age = rbus.kv_event_age_s()  # added after `before` (its id's milliseconds round down)
    assert age is not None and 0 <= age <= time.time() - before + 0.002
    assert await rbus.kv_events(block_ms=10) == []
    assert rbus.kv_event_age_s() is None  # nothing read: no age
    await a.close()


async def test_a_resync_request_is_seen_once(rbus: RedisBus) -> None:
    a = await started(rbus, "a")
    assert not await a.resync_requested()
    await rbus.request_resync("a")
    assert await a.resync_requested()
    assert not await a.resync_requested()
    await a.close()


async def test_a_bus_whose_keys_vanished_recovers(live_bus: RedisBus) -> None:
    """As after a Redis restart without persistence: groups, registrations and streams gone."""
    rbus = live_bus
    a = await started(rbus, "a")
    keys: list[Any] = [k async for k in rbus.redis.scan_iter(match=f"{rbus.config.prefix}:*")]
    await rbus.redis.delete(*keys)
    assert await rbus.workers() == {}
    await a.heartbeat()  # the next heartbeat registers the worker again
    assert set(await rbus.workers()) == {"a"}
    await rbus.submit(request("after"), worker="a")  # creates the stream, not the group
    got = await receive_until(a)  # the first read finds no group and creates it
    assert [d.request.request_id for d in got] == ["after"]
    await a.ack(got[0])
    await a.close()
