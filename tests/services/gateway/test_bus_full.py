"""The gateway on a bus that refuses writes (its Redis at maxmemory with `noeviction`, as
compose.yaml's bus runs): a new request is answered 503 with Retry-After, not 500; and a request
that asks for a fault is refused unless the gateway was started to accept one."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from kvserve.services.bench.lib.redis_server import RedisServer
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.schema import ModelInfo
from kvserve.shared.bus.redis import RedisBus
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.protocol import GenerateRequest
from kvserve.shared.tasks import cancel_and_wait

Answer = tuple[int, dict[str, str], dict[str, Any]]


async def post(server: TestServer, body: dict[str, object]) -> Answer:
    url = server.make_url("/v1/completions")
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as r:
        return r.status, dict(r.headers), await r.json()


async def test_a_full_bus_is_503_and_faults_need_the_flag(
    tokenizer: KVTokenizer, redis_server: RedisServer
) -> None:
    bus = RedisBus(redis_server.url)
    info = ModelInfo("m", tokenizer, 8192, tokenizer.vocab_size)
    strict = TestServer(Gateway(GatewayConfig(), bus, info).app, host="127.0.0.1")
    lax = TestServer(Gateway(GatewayConfig(fault_injection=True), bus, info).app, host="127.0.0.1")
    await strict.start_server()
    await lax.start_server()
    port = bus.worker("w")
    await port.start()  # a live worker: /ready passes
    try:
        body = {"prompt": "hi", "max_tokens": 2, "kvserve_fault": "raise"}
        status, _, err = await post(strict, body)
        assert status == 400 and err["error"]["param"] == "kvserve_fault"
        status, _, err = await post(lax, {**body, "kvserve_fault": "explode"})
        assert status == 400 and err["error"]["param"] == "kvserve_fault"
        # The lax gateway passes the fault on (the request is left unanswered, then dropped).
        sent = asyncio.create_task(post(lax, body))
        deliveries = []
        while not deliveries and not sent.done():
            deliveries = await port.receive(max_count=1, timeout=1)
        (d,) = deliveries
        assert isinstance(d.request, GenerateRequest) and d.request.sampling.fault == "raise"
        await cancel_and_wait(sent)
        r_admin = bus.redis
        await r_admin.config_set("maxmemory-policy", "noeviction")
        await r_admin.config_set("maxmemory", "1")  # every write now refused
        try:
            status, headers, err = await post(strict, {"prompt": "hi", "max_tokens": 2})
        finally:
            await r_admin.config_set("maxmemory", "0")
        assert status == 503 and err["error"]["code"] == "bus_full"
        assert headers.get("Retry-After") == "1"
    finally:
        await port.close()
        await strict.close()
        await lax.close()
        await bus.close()
