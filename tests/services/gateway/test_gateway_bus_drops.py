"""The gateway over a Redis bus (marker `redis`) with a scripted worker: bad entries among a
request's events and a bad stats report are dropped, the request is served, and the drops show
in /v1/cache/stats and as `kvserve:bus_dropped_messages_total` on /metrics."""

from __future__ import annotations

import pytest
from kvserve.shared.bus.base import Delivery, WorkerPort
from kvserve.shared.model.tokenizer import KVTokenizer

from tests.services.gateway.test_gateway_unit import Harness, tokens
from tests.shared.bus.test_bus import drop, make_redis_bus

pytestmark = pytest.mark.redis


async def test_the_gateway_drops_bad_entries_counts_them_and_serves_the_request(
    tokenizer: KVTokenizer,
) -> None:
    bus = await make_redis_bus(max_message_bytes=4096)

    async def bad_entries_first(port: WorkerPort, d: Delivery) -> None:
        rid = d.request.request_id
        for fields in ({b"m": b"\xc1 garbage"}, {b"x": b"no m"}, {b"m": b"\x00" * 5000}):
            await bus.redis.xadd(bus.keys.out_key(rid), fields)
        await port.emit(tokens(rid, 0, "ok", finish="stop"))

    try:
        async with Harness(tokenizer, bus=bus, request_timeout_s=10.0) as h:
            await h.start_worker(bad_entries_first)
            await bus.redis.hset(bus.keys.stats_key, "fake", b"\xc1 not a report")
            body = {"model": "m", "prompt": "Hi", "max_tokens": 1}
            status, answer, text = await h.post("/v1/completions", body)
            assert status == 200, text
            assert answer["choices"][0]["text"] == "ok"
            async with h.session.get("/v1/cache/stats") as r:
                stats = await r.json()
            assert stats["workers"] == {"fake": {}}
            assert stats["gateway"]["bus_dropped"] == {
                "events": {"missing_field": 1, "not_msgpack": 1, "oversized": 1},
                "worker_stats": {"not_msgpack": 1},
            }
            async with h.session.get("/metrics") as r:
                lines = (await r.text()).splitlines()
            name = "kvserve:bus_dropped_messages_total"
            assert [line for line in lines if line.startswith(name + "{")] == [
                f'{name}{{model_name="m",reason="{reason}",stream="{stream}",worker=""}} 1.0'
                for stream, reason in [
                    ("events", "missing_field"),
                    ("events", "not_msgpack"),
                    ("events", "oversized"),
                    ("worker_stats", "not_msgpack"),
                ]
            ]
            await h.port.close()
    finally:
        await drop(bus)
