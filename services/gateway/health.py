"""The operations routes: GET /health (liveness), /ready (readiness: a worker is up and the
gateway is not draining), /metrics (Prometheus, with the workers' engine stats fetched at
scrape time, and the bus messages the gateway dropped) and /version."""

from __future__ import annotations

import contextlib

from aiohttp import web
from kvserve.services.gateway.context import GatewayContext
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

VERSION = "0.1.0"


class HealthRoutes:
    """Stateless: each answer is read from the context when asked."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    async def health(self, request: web.Request) -> web.Response:
        dead = self.ctx.readiness.dead
        if dead is not None:
            return web.json_response({"status": "failed", "reason": dead}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if self.ctx.admission.draining:
            return web.json_response({"status": "draining"}, status=503)
        status = await self.ctx.readiness.serving()
        return web.json_response({"status": status}, status=200 if status == "ready" else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        metrics = self.ctx.metrics
        with contextlib.suppress(Exception):  # a bus hiccup must not fail the scrape
            metrics.engine.snapshot = await self.ctx.bus.stats()
        metrics.engine.own_bus_dropped = self.ctx.bus.dropped()
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION, "model": self.ctx.model.name})
