"""EngineWorker with the real engine on the Redis bus (marker `redis`): a bad entry on its
request streams (the shared one, its own, or one claimed from a consumer that died) or on the
cancel stream is dropped (a request acked and deleted), counted in the worker's stats and on its
/metrics, its loops go on, and the next request is served end to end with the engine's tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from kvserve.services.workers.engine_worker import EngineWorker
from kvserve.services.workers.metrics import WorkerStatsCollector
from kvserve.shared.bus.redis import RedisBus
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.protocol import GenerateRequest
from kvserve.shared.sampling_params import SamplingParams
from prometheus_client import CollectorRegistry, generate_latest

from tests.polling import until
from tests.shared.bus.test_bus import drop, make_redis_bus
from tests.shared.bus.test_drops import BAD, MAX_BYTES, SAMPLES

pytestmark = pytest.mark.redis

SP = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture
async def bus() -> AsyncIterator[RedisBus]:
    b = await make_redis_bus(claim_idle_s=0.0, max_message_bytes=MAX_BYTES)
    try:
        yield b
    finally:
        await drop(b)


@pytest.fixture(scope="module")
def expected(services_engine: Any, chat_prompt_ids: list[list[int]]) -> list[int]:
    """The engine's greedy tokens for the valid request (before any worker thread runs it)."""
    return list(services_engine.generate([chat_prompt_ids[0]], SP)[0][0])


def metric_lines(worker: EngineWorker) -> list[str]:
    """The worker's /metrics (its collector reads worker.stats at each scrape)."""
    registry = CollectorRegistry()
    registry.register(WorkerStatsCollector("m", "w", worker.stats))
    name = "kvserve:bus_dropped_messages_total{"
    return [s for s in generate_latest(registry).decode().splitlines() if s.startswith(name)]


@pytest.mark.parametrize("where", ["shared", "own", "claimed"])
@pytest.mark.parametrize("bad", list(BAD))
async def test_a_bad_request_is_dropped_and_the_next_served(
    bus: RedisBus,
    services_engine: Any,
    chat_prompt_ids: list[list[int]],
    expected: list[int],
    where: str,
    bad: str,
) -> None:
    make, reason = BAD[bad]
    key = bus.keys.to_key("w") if where == "own" else bus.keys.request_key
    await bus.redis.xgroup_create(key, bus.config.group, id="0", mkstream=True)
    await bus.redis.xadd(key, make(SAMPLES["requests"]))
    if where == "claimed":  # delivered to a consumer that died: the worker claims it
        await bus.redis.xreadgroup(bus.config.group, "gone", {key: ">"})
    worker = EngineWorker(bus.worker("w"), AsyncEngine(services_engine), poll_s=0.05)
    await worker.start()
    try:
        await until(lambda: worker.stats()["bus_dropped"], "the bad entry was never read")
        assert worker.stats()["bus_dropped"] == {"requests": {reason: 1}}
        assert not any(task.done() for task in worker._loops)
        routed = "w" if where == "own" else None
        stream = await bus.submit(GenerateRequest("good", chat_prompt_ids[0], SP), routed)
        events = [ev async for ev in stream]
        assert [t for e in events for t in e.token_ids] == expected
        assert events[-1].finish_reason == "length"
        await until(lambda: worker.num_running == 0, "the request never ended")
        assert (await bus.redis.xpending(key, bus.config.group))["pending"] == 0
        assert await bus.redis.xlen(key) == 0  # the bad entry and the request, both deleted
        assert metric_lines(worker) == [
            f'kvserve:bus_dropped_messages_total{{model_name="m",reason="{reason}",'
            f'stream="requests",worker="w"}} 1.0'
        ]
    finally:
        await worker.stop(drain_timeout=0)
        worker.engine.stop()


async def test_bad_cancels_are_dropped_and_the_next_one_cancels(
    bus: RedisBus, services_engine: Any, chat_prompt_ids: list[list[int]]
) -> None:
    worker = EngineWorker(bus.worker("w"), AsyncEngine(services_engine), poll_s=0.05)
    await worker.start()
    try:
        long = SamplingParams(max_tokens=500, ignore_eos=True)
        stream = await bus.submit(GenerateRequest("c", chat_prompt_ids[1], long))
        it = aiter(stream)
        assert (await anext(it)).token_ids
        for make, _ in BAD.values():
            await bus.redis.xadd(bus.keys.cancel_key, make(SAMPLES["cancel"]))
        await bus.cancel("c")
        rest = [ev async for ev in it]
        assert rest[-1].error is not None and rest[-1].error.type == "cancelled"
        counts: dict[str, int] = {}
        for _, reason in BAD.values():
            counts[reason] = counts.get(reason, 0) + 1
        assert worker.stats()["bus_dropped"] == {"cancel": counts}
        assert not any(task.done() for task in worker._loops)
        # The gateway's side of the same bus reads the worker's real report as it is.
        await worker.port.heartbeat()  # type: ignore[attr-defined]  # publish it now
        assert (await bus.stats())["w"]["bus_dropped"] == {"cancel": counts}
        assert "worker_stats" not in bus.dropped()
    finally:
        await worker.stop(drain_timeout=0)
        worker.engine.stop()
