"""Probation on the real Redis bus with the real engine: a taken-over request whose worker died
while it ran on probation carries a strike; at `quarantine_after` deaths it is failed with code
"quarantined" and never run, while the request that died beside it is taken over and finishes
with its greedy answer. (A worker's death is a port that claims and goes away without acking:
a process cannot be killed in-process.)"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kvserve.services.bench.lib.redis_server import redis_answers
from kvserve.services.workers.engine_worker import EngineWorker
from kvserve.shared.bus.redis import RedisBus
from kvserve.shared.bus.redis_layout import RedisBusConfig
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.protocol import GenerateRequest
from kvserve.shared.sampling_params import SamplingParams

from tests.polling import until

REDIS_URL = "redis://127.0.0.1:6379/13"
pytestmark = pytest.mark.redis


async def test_the_request_on_probation_takes_the_blame(
    services_engine: Any, chat_prompt_ids: list[list[int]]
) -> None:
    if not await redis_answers(REDIS_URL):
        pytest.skip(f"no Redis at {REDIS_URL}")
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = services_engine.generate([chat_prompt_ids[1]], sp)[0][0]
    prefix = f"kvtest-{uuid.uuid4().hex[:12]}"
    bus = RedisBus(REDIS_URL, RedisBusConfig(prefix=prefix, claim_idle_s=0.0))
    worker = None
    try:
        killer = await bus.submit(GenerateRequest("killer", chat_prompt_ids[0], sp))
        bystander = await bus.submit(GenerateRequest("bystander", chat_prompt_ids[1], sp))
        # Worker a takes both and dies (its first run of each: no probation, no strike).
        a = bus.worker("a")
        await a.start()
        assert len(await a.receive(timeout=5)) == 2
        await a.close()
        # Worker b takes both over and dies while `killer` is on probation.
        b = bus.worker("b")
        await b.start()
        taken = await b.receive(timeout=5)
        assert sorted(d.request.request_id for d in taken) == ["bystander", "killer"]
        assert await b.strikes("killer") == 0
        await b.begin_probation("killer")
        await b.close()
        # Worker c takes both over: `killer` has killed two workers, `bystander` none.
        worker = EngineWorker(bus.worker("c"), AsyncEngine(services_engine), poll_s=0.05)
        await worker.start()
        (err,) = [ev async for ev in killer]
        assert err.error is not None and err.error.code == "quarantined"
        assert "2 workers died" in err.error.message and err.epoch == 3
        events = [ev async for ev in bystander]
        assert [t for e in events for t in e.token_ids] == expected
        assert worker.quarantined == 1 and worker.stats()["num_requests_quarantined"] == 1
        # Both are acked, each after its last event: the client may read that event first.

        async def all_acked() -> bool:
            pending = await bus.redis.xpending(bus.keys.request_key, "prefill")
            return pending["pending"] == 0

        await until(all_acked, "a delivery was never acked")
    finally:
        if worker is not None:
            await worker.stop(drain_timeout=0)
            worker.engine.stop()
        keys = [k async for k in bus.redis.scan_iter(match=f"{prefix}:*")]
        if keys:
            await bus.redis.delete(*keys)
        await bus.close()
