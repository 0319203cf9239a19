"""What the fleet end-to-end tests share: the bench harness's Fleet (gateway and workers as real
processes) on a redis-server of its own, which is their bus and store; the gateway; an `openai`
client for it; the router's stats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
from kvserve.services.bench.lib import fleet as harness
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import STOP_GRACE_S, ServerProcess
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.bench.lib.redis_server import RedisServer

from tests.services.openai_suite import MODEL


class RedisFleet(harness.Fleet):
    def __init__(self, model_path: Path) -> None:
        super().__init__(model_path)
        self.redis = RedisServer()
        self.redis.start()

    def gateway(self, *flags: str) -> ServerProcess:
        """The gateway on this fleet's bus, serving MODEL, with `flags` besides."""
        return self.process(
            "gateway", ("gateway", "--port", "0"), "--bus", self.redis.url,
            "--served-model-name", MODEL, *flags,
        ).spawn()  # fmt: skip

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.procs["gateway"].url + "/v1", api_key="x", max_retries=0)

    def router(self) -> dict[str, Any]:
        """The gateway's router stats (asked again while Redis, just back, refuses a call)."""
        http = Http(self.procs["gateway"].url)
        reply = poll_until(lambda: (r := http.get("/v1/cache/stats")).status_code == 200 and r)
        return dict(reply.json()["router"])

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        super().stop(grace)
        self.redis.stop()
