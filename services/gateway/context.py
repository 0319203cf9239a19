"""GatewayContext: the collaborators the gateway's route families share, built once by
`Gateway` (app.py) and handed to each of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web
from kvserve.services.gateway.admission import Admission
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.config import GatewayConfig
from kvserve.services.gateway.middleware import json_body
from kvserve.services.gateway.readiness import Readiness
from kvserve.services.gateway.routing import RoutingService
from kvserve.services.gateway.schema import ModelInfo
from kvserve.shared.bus.base import Bus
from kvserve.shared.telemetry import Metrics


@dataclass(frozen=True)
class GatewayContext:
    """Frozen: no part is ever rebound. The parts keep their own state (admission's count and
    draining flag, the metrics, the router's index); `routing` is None without a policy."""

    config: GatewayConfig
    bus: Bus
    model: ModelInfo
    metrics: Metrics
    keys: ApiKeys
    admission: Admission
    readiness: Readiness
    routing: RoutingService | None

    async def json_body(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object, within the configured body limit."""
        return await json_body(request, self.config.max_body_bytes)
