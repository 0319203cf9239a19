"""Fenced take-overs on the Redis bus: a worker paused (not dead) past the claim timeout, whose
request another worker took over, cannot mix its events into the client's stream, learns on its
next heartbeat that the delivery is gone, and its ack does not ack the new holder's delivery.
Against the real Redis (marker `redis`)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kvserve.services.bench.lib.redis_server import redis_answers
from kvserve.services.workers.token_events import taken_over
from kvserve.shared.bus.base import Delivery
from kvserve.shared.bus.redis import RedisBus
from kvserve.shared.bus.redis_layout import RedisBusConfig
from kvserve.shared.protocol import GenerateRequest, TokenEvent, fence_event
from kvserve.shared.sampling_params import SamplingParams

REDIS_URL = "redis://127.0.0.1:6379/13"
pytestmark = pytest.mark.redis


async def make_bus() -> RedisBus:
    if not await redis_answers(REDIS_URL):
        pytest.skip(f"no Redis at {REDIS_URL}")
    prefix = f"kvtest-{uuid.uuid4().hex[:12]}"
    return RedisBus(REDIS_URL, RedisBusConfig(prefix=prefix, claim_idle_s=0.0))


async def drop(bus: RedisBus) -> None:
    keys = [k async for k in bus.redis.scan_iter(match=f"{bus.config.prefix}:*")]
    if keys:
        await bus.redis.delete(*keys)
    await bus.close()


def token(seq: int, text: str, epoch: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent("r1", seq, 0, [seq], text, finish_reason=finish, epoch=epoch)


async def owner(bus: RedisBus) -> Any:
    rows = await bus.redis.xpending_range(bus.keys.request_key, "prefill", "-", "+", 10)
    return [(r["consumer"].decode(), r["times_delivered"]) for r in rows]


async def test_a_stale_holder_is_fenced_off_and_told() -> None:
    bus = await make_bus()
    try:
        req = GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4))
        stream = await bus.submit(req)
        stale = bus.worker("stale")
        await stale.start()
        lost: list[Delivery] = []
        stale.on_taken_over = lost.append
        (first,) = await stale.receive(timeout=5)
        assert first.epoch == 1
        await stale.emit(token(0, "a", 1))
        await stale.emit(token(1, "b", 1))
        # `stale` stops heartbeating (paused); `fresh` claims the request as from a dead worker.
        assert stale._heartbeat_task is not None  # type: ignore[attr-defined]
        stale._heartbeat_task.cancel()  # type: ignore[attr-defined]
        fresh = bus.worker("fresh")
        await fresh.start()
        (again,) = await fresh.receive(timeout=5)
        assert again.redelivered and again.epoch == 2
        await fresh.emit(fence_event("r1", again.epoch))
        taken = taken_over(await fresh.emitted("r1"), 1)
        assert taken.next_seq == 2 and taken.completions[0].text == "ab"
        # `stale` resumes: its events after the fence are stale, whatever their seq.
        await stale.emit(token(2, "STALE", 1))
        await stale.emit(token(3, "STALE", 1, "stop"))
        await fresh.emit(token(2, "c", 2))
        await fresh.emit(token(3, "d", 2, "stop"))
        got = [ev async for ev in stream]
        assert "".join(e.text for e in got) == "abcd"
        assert [e.epoch for e in got] == [1, 1, 2, 2]
        assert bus.drops.count("events", "stale") == 2
        # A later reader (a third take-over) folds the same view.
        assert taken_over(await fresh.emitted("r1"), 1).completions[0].text == "abcd"
        # Its next heartbeat tells `stale` the delivery is gone; its ack leaves fresh's alone.
        await stale.heartbeat()  # type: ignore[attr-defined]
        assert [d.message_id for d in lost] == [first.message_id]
        await stale.ack(first)
        assert await owner(bus) == [("fresh", 2)]
        await fresh.heartbeat()  # type: ignore[attr-defined]
        assert await owner(bus) == [("fresh", 2)]  # the live holder keeps it
        await fresh.ack(again)
        assert await owner(bus) == []
        await stream.close()
        await fresh.close()
        await stale.close()
    finally:
        await drop(bus)


async def test_a_takeover_without_a_stale_holder_reads_every_event() -> None:
    """Events of the first epoch written before the fence all count (the client has them)."""
    events = [token(0, "a", 1), fence_event("r1", 2), token(1, "b", 1), token(1, "B", 2)]
    # token(1, "b", 1) arrived after the fence: stale, dropped; the new holder's seq 1 counts.
    assert taken_over(events, 1).completions[0].text == "aB"
