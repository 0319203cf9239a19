"""Bus input is never trusted, against the real Redis (marker `redis`): on every stream and hash
a gateway or a worker reads, a bad entry (garbage, truncated msgpack of a valid message,
another protocol version, a mistyped field, no `m` field, one over the size bound) is counted
under its stream kind and reason and dropped, the reader goes on, and the next valid message
is read; a dropped request is acked and deleted (never delivered again)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
from kvserve.shared.bus.base import WorkerPort
from kvserve.shared.bus.drops import BusDrops
from kvserve.shared.bus.redis import RedisBus
from kvserve.shared.bus.redis_layout import RedisBusConfig
from kvserve.shared.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    GenerateRequest,
    KVEvent,
    Message,
    TokenEvent,
    WorkerInfo,
    encode,
)
from kvserve.shared.sampling_params import SamplingParams

from tests.polling import until
from tests.shared.bus.test_bus import drop, make_redis_bus, request

pytestmark = pytest.mark.redis

MAX_BYTES = 4096  # the test bus's bound (the default is 8 MiB)
DEADLINE_S = 10.0


@dataclass(frozen=True)
class Sample:
    """A stream kind's valid entry, the same with one field mistyped, and a valid one too big."""

    valid: bytes
    wrong_type: bytes
    big: bytes

    @property
    def other_version(self) -> bytes:
        return _repack(self.valid, v=PROTOCOL_VERSION + 1)


def _repack(data: bytes, **over: Any) -> bytes:
    return bytes(msgpack.packb({**msgpack.unpackb(data, raw=False), **over}))


def sample(msg: Message, big: Message, **wrong: Any) -> Sample:
    return Sample(encode(msg), _repack(encode(msg), **wrong), encode(big))


def worker_info(name: str = "w", model_fp: str = "m") -> WorkerInfo:
    return WorkerInfo(name, "worker", "inc", 16, model_fp, "t", "float32", "", 1.0)


def kv_event(seq: int = 0, n: int = 1) -> KVEvent:
    return KVEvent("w", "inc", seq, "stored", "device", [bytes([seq]) * 32] * n)


SAMPLES = {
    "requests": sample(
        request("bad"),
        GenerateRequest("big", [50_000] * 2000, SamplingParams()),
        prompt_token_ids="1 2 3",
    ),
    "cancel": sample(Cancel("bad"), Cancel("big", "x" * MAX_BYTES), request_id=5),
    "events": sample(TokenEvent("r1", 0), TokenEvent("r1", 0, text="x" * MAX_BYTES), seq="0"),
    "kv_events": sample(kv_event(), kv_event(n=200), seq="0"),
    "worker_info": sample(worker_info(), worker_info(model_fp="m" * MAX_BYTES), block_size="16"),
    "worker_stats": Sample(
        bytes(msgpack.packb({"num_used_blocks": 3})),
        bytes(msgpack.packb({"num_used_blocks": b"\x03"})),  # bytes: not a plain value
        bytes(msgpack.packb({"pad": "x" * MAX_BYTES})),
    ),
}
# bad entry -> (how to make it from a sample, the reason it is counted under)
BAD: dict[str, tuple[Callable[[Sample], dict[bytes, bytes]], str]] = {
    "garbage": (lambda s: {b"m": b"\xc1\xff not msgpack"}, "not_msgpack"),
    "truncated": (lambda s: {b"m": s.valid[: len(s.valid) // 2]}, "not_msgpack"),
    "other_version": (lambda s: {b"m": s.other_version}, "version"),
    "wrong_type": (lambda s: {b"m": s.wrong_type}, "invalid"),
    "missing_m": (lambda s: {b"x": s.valid}, "missing_field"),
    "oversized": (lambda s: {b"m": s.big}, "oversized"),
}


@pytest.fixture
async def rbus() -> AsyncIterator[RedisBus]:
    # Claims at once; no heartbeat after start (a test writes the hashes itself).
    b = await make_redis_bus(claim_idle_s=0.0, heartbeat_s=60.0, max_message_bytes=MAX_BYTES)
    try:
        yield b
    finally:
        await drop(b)


async def started(bus: RedisBus, name: str = "w") -> WorkerPort:
    port = bus.worker(name)
    await port.start(lambda: {"num_used_blocks": 3}, worker_info(name))
    return port


# ---- one reader per stream kind: write the bad entry, then check the next valid one ----------


async def the_shared_request_stream(bus: RedisBus, entry: dict[bytes, bytes]) -> BusDrops:
    port = await started(bus)
    await bus.redis.xadd(bus.keys.request_key, entry)
    await bus.submit(request("good"))
    await _receive_only_good(bus, port, bus.keys.request_key)
    return bus.drops


async def a_workers_own_stream(bus: RedisBus, entry: dict[bytes, bytes]) -> BusDrops:
    port = await started(bus)
    await bus.redis.xadd(bus.keys.to_key("w"), entry)
    await bus.submit(request("good"), worker="w")
    await _receive_only_good(bus, port, bus.keys.to_key("w"))
    return bus.drops


async def a_claimed_request(bus: RedisBus, entry: dict[bytes, bytes]) -> BusDrops:
    """The bad entry was delivered to a consumer that died: the live worker claims it."""
    port = await started(bus)
    key = bus.keys.request_key
    await bus.redis.xadd(key, entry)
    await bus.redis.xreadgroup(bus.config.group, "gone", {key: ">"})
    port._last_claim = 0.0  # type: ignore[attr-defined]  # claim on this call, not per beat
    assert await port.receive(timeout=0.01) == []
    await bus.submit(request("good"))
    await _receive_only_good(bus, port, key)
    return bus.drops


async def _receive_only_good(bus: RedisBus, port: WorkerPort, key: str) -> None:
    got = await until(lambda: port.receive(timeout=0.1), "the valid request never came", DEADLINE_S)
    assert [d.request.request_id for d in got] == ["good"]
    await port.ack(got[0])
    assert (await bus.redis.xpending(key, bus.config.group))["pending"] == 0
    assert await bus.redis.xlen(key) == 0  # the bad entry was deleted with its ack


async def the_cancel_stream(bus: RedisBus, entry: dict[bytes, bytes]) -> BusDrops:
    port = await started(bus)
    await bus.redis.xadd(bus.keys.cancel_key, entry)
    await bus.cancel("good", "client")
    got = await until(lambda: port.cancels(timeout=0.1), "the valid cancel never came", DEADLINE_S)
    assert got == [Cancel("good", "client")]
    return bus.drops


async def a_requests_events_at_the_gateway(bus: RedisBus, entry: dict[bytes, bytes]) -> BusDrops:
    port = await started(bus)
    stream = await bus.submit(request("r1"))
    await bus.redis.xadd(bus.keys.out_key("r1"), entry)

    async def counted() -> bool:
        await bus.redis.ping()  # a round trip, not a sleep: the reader reads meanwhile
        return bool(bus.dropped())

    await until(counted, "the bad event was never counted", DEADLINE_S)
    task = bus.reader._task
    assert task is not None and not task.done()  # the one reader of every request goes on
    await port.emit(TokenEvent("r1", 0, 0, [7], "ok", finish_reason="stop"))
    got = [ev async for ev in stream]
    assert [(e.seq, e.text) for e in got] == [(0, "ok")]
    await stream.close()
    return bus.drops


async def a_requests_events_taken_over(bus: RedisBus, entry: dict[bytes, bytes]) -> BusDrops:
    port = await started(bus)
    await bus.redis.xadd(bus.keys.out_key("r1"), entry)
    await port.emit(TokenEvent("r1", 0, 0, [7], "ok"))
    assert await port.emitted("r1") == [TokenEvent("r1", 0, 0, [7], "ok")]
    return bus.drops


async def the_kv_events_stream(bus: RedisBus, entry: dict[bytes, bytes]) -> BusDrops:
    port = await started(bus)
    await bus.redis.xadd(bus.keys.kv_events_key, entry)
    await port.publish_kv_events([kv_event(1)])
    got = await until(
        lambda: bus.kv_events(block_ms=100), "the valid KV event never came", DEADLINE_S
    )
    assert got == [kv_event(1)]
    return bus.drops


async def the_worker_info_hash(bus: RedisBus, entry: dict[bytes, bytes]) -> BusDrops:
    port = await started(bus)
    assert await bus.workers() == {"w": worker_info()}
    await bus.redis.hset(bus.keys.info_key, "w", entry[b"m"])
    assert await bus.workers() == {}
    assert await bus.workers() == {}  # read again: counted once
    await port.heartbeat()  # publishes the valid one again
    assert await bus.workers() == {"w": worker_info()}
    return bus.drops


async def the_worker_stats_hash(bus: RedisBus, entry: dict[bytes, bytes]) -> BusDrops:
    port = await started(bus)
    await bus.redis.hset(bus.keys.stats_key, "w", entry[b"m"])
    assert await bus.stats() == {"w": {}}
    assert await bus.stats() == {"w": {}}  # read again: counted once
    await port.heartbeat()
    assert (await bus.stats())["w"]["num_used_blocks"] == 3
    return bus.drops


READERS = {
    "requests": [the_shared_request_stream, a_workers_own_stream, a_claimed_request],
    "cancel": [the_cancel_stream],
    "events": [a_requests_events_at_the_gateway, a_requests_events_taken_over],
    "kv_events": [the_kv_events_stream],
    "worker_info": [the_worker_info_hash],
    "worker_stats": [the_worker_stats_hash],
}
HASHES = ("worker_info", "worker_stats")  # a value, not a stream entry: no `m` field
UNVERSIONED = ("worker_stats",)
CASES = [
    pytest.param(stream, reader, bad, id=f"{reader.__name__}-{bad}")
    for stream, readers in READERS.items()
    for reader in readers
    for bad in BAD
    if not (stream in HASHES and bad == "missing_m")
    and not (stream in UNVERSIONED and bad == "other_version")
]


@pytest.mark.parametrize(("stream", "reader", "bad"), CASES)
async def test_a_bad_entry_is_counted_dropped_and_the_next_one_read(
    rbus: RedisBus, stream: str, reader: Any, bad: str
) -> None:
    make, reason = BAD[bad]
    drops = await asyncio.wait_for(reader(rbus, make(SAMPLES[stream])), DEADLINE_S)
    assert drops.snapshot() == {stream: {reason: 1}}


async def test_a_resync_key_of_another_type_is_dropped_and_the_next_request_seen(
    rbus: RedisBus,
) -> None:
    port = await started(rbus)
    await rbus.redis.rpush(rbus.keys.resync_key("w"), b"1")  # a list, not a router's string
    assert not await port.resync_requested()
    assert port.dropped() == {"resync": {"invalid": 1}}
    await rbus.request_resync("w")
    assert await port.resync_requested()


async def test_an_event_of_another_request_or_completion_is_dropped(rbus: RedisBus) -> None:
    port = await started(rbus)
    stream = await rbus.submit(request("r1", n=2))
    for ev in (TokenEvent("r9", 0), TokenEvent("r1", 0, index=2), Cancel("r1")):
        await rbus.redis.xadd(rbus.keys.out_key("r1"), {b"m": encode(ev)})
    await port.emit(TokenEvent("r1", 0, 0, finish_reason="stop"))
    await port.emit(TokenEvent("r1", 1, 1, finish_reason="stop"))
    got = [ev async for ev in stream]
    assert [(e.seq, e.index) for e in got] == [(0, 0), (1, 1)]
    assert rbus.dropped() == {"events": {"invalid": 3}}
    await stream.close()


def test_the_default_bound_admits_a_full_context_request() -> None:
    """A million-token prompt of the largest token ids (5 bytes each in msgpack) fits under the
    default bound; twice that does not."""
    bound = RedisBusConfig().max_message_bytes
    sp = SamplingParams(stop=("a" * 100,) * 16)
    assert len(encode(GenerateRequest("r", [2**32 - 1] * (1 << 20), sp, "s" * 64))) < bound
    assert len(encode(GenerateRequest("r", [2**32 - 1] * (2 << 20), sp))) > bound


def test_warnings_are_rate_limited_per_stream_and_reason(caplog: Any) -> None:
    drops = BusDrops(MAX_BYTES, log_every_s=60.0)
    with caplog.at_level("WARNING", logger="kvserve.shared.bus"):
        for _ in range(3):
            drops.record("cancel", "invalid", "k 1-0", "bad")
        drops.record("cancel", "version", "k 2-0", "bad")
    assert drops.snapshot() == {"cancel": {"invalid": 3, "version": 1}}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "stream=cancel reason=invalid" in lines[0] and "stream=cancel reason=version" in lines[1]


async def test_a_registration_that_is_not_text_is_no_worker(rbus: RedisBus) -> None:
    port = await started(rbus)
    await rbus.redis.zadd(rbus.keys.workers_key, {b"\xff\xfe": time.time(), b"\xc1": 0})
    assert await rbus.live_workers() == ["w"]
    assert await rbus.dead_workers() == []
    port._last_claim = 0.0  # type: ignore[attr-defined]  # look for dead workers on this call
    assert await port.receive(timeout=0.01) == []
