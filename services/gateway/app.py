"""The OpenAI-compatible gateway (aiohttp). Talks only to the bus; never imports torch.

Request path: auth (bearer key -> tenant cache salt) -> body (size limit, JSON) -> schema
(validate, tokenize, chat template) -> admission (bounded in-flight, draining) -> route (with
`GatewayConfig.routing`: the worker that holds most of the prompt's KV for its load) -> bus (one
request per prompt) -> events -> response (JSON, or SSE chunks and `data: [DONE]`).

`Gateway` wires the app: the middlewares (middleware.py), the route table (each route with its
OpenAPI description and its handler in one of the route families: completions.py,
model_routes.py, cache_admin.py, health.py), the document built from that same table, and the
router's start and stop. The invariants of a generation request are in completions.py.
"""

from __future__ import annotations

from aiohttp import web
from kvserve.services.gateway import request_schemas as req
from kvserve.services.gateway import response_schemas as res
from kvserve.services.gateway.admission import Admission
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.cache_admin import CacheAdmin
from kvserve.services.gateway.completions import CompletionRoutes
from kvserve.services.gateway.config import GatewayConfig
from kvserve.services.gateway.context import GatewayContext
from kvserve.services.gateway.health import VERSION, HealthRoutes
from kvserve.services.gateway.middleware import Handler, Middleware
from kvserve.services.gateway.model_routes import ModelRoutes
from kvserve.services.gateway.openapi import RouteDoc, build_openapi
from kvserve.services.gateway.readiness import Readiness
from kvserve.services.gateway.router import Router
from kvserve.services.gateway.routing import RoutingService
from kvserve.services.gateway.schema import ModelInfo
from kvserve.shared.bus.base import Bus
from kvserve.shared.telemetry import Metrics, get_logger

__all__ = ["Gateway", "GatewayConfig"]
log = get_logger("kvserve.gateway")


class Gateway:
    """`app` is the aiohttp application; `admission` counts the generation requests in flight
    and holds the draining state (`start_draining`, then `admission.drained(timeout)`)."""

    def __init__(self, config: GatewayConfig, bus: Bus, model: ModelInfo) -> None:
        self.config = config
        self.metrics = Metrics(model.name)
        self.admission = Admission(config.max_in_flight, config.retry_after_s)
        self.metrics.in_flight.set_function(lambda: self.admission.in_flight)
        keys = ApiKeys(config.api_keys, config.allow_client_cache_salt)
        middleware = Middleware(config, self.metrics, keys)
        self.app = web.Application(
            client_max_size=config.max_body_bytes,
            middlewares=[middleware.errors, middleware.auth],
        )
        self.routing = self._routing(bus)
        self.context = GatewayContext(
            config, bus, model, self.metrics, keys, self.admission,
            Readiness(bus, config.retry_after_s), self.routing,
        )  # fmt: skip
        self.cache = CacheAdmin(self.context)  # its warm-up jobs are cancelled at cleanup
        self.app.on_cleanup.append(self.cache.cancel_warmups)
        facts = req.ApiFacts.of(model, keys.enabled, config.allow_client_cache_salt)
        self.routes = self._routes(facts)
        for r, handler in self.routes:
            self.app.router.add_route(r.method, r.path, handler)
        self.openapi = build_openapi([r for r, _ in self.routes], "kvserve", VERSION, facts)
        if self.routing is not None:
            self._run_with_app(self.routing)

    def _routing(self, bus: Bus) -> RoutingService | None:
        """The router's service (None without a routing policy)."""
        c = self.config
        if c.routing is None:
            return None
        router = Router(c.routing, c.overlap_weight, c.router_max_blocks, c.router_store_cost)
        return RoutingService(bus, router, self.metrics.registry, pd_threshold=c.pd_threshold)

    def _run_with_app(self, routing: RoutingService) -> None:
        """Start the router with the app; stop it at cleanup (after the warm-up jobs)."""

        async def start(_app: web.Application) -> None:
            await routing.start()

        async def stop(_app: web.Application) -> None:
            await routing.stop()

        self.app.on_startup.append(start)
        self.app.on_cleanup.append(stop)

    def _routes(self, f: req.ApiFacts) -> list[tuple[RouteDoc, Handler]]:
        """Each route's description and handler, in the document's order."""
        gen, models = CompletionRoutes(self.context), ModelRoutes(self.context)
        cache, health = self.cache, HealthRoutes(self.context)
        json_errors = (400, 401, 404, 413, 429, 503)
        model = {"model": req.model_schema(f)}
        return [
            (RouteDoc("POST", "/v1/completions", "Text completion (OpenAI).",
                      req.completion_request(f), res.COMPLETION_RESPONSE, stream=True, auth=True,
                      errors=(*json_errors, 504)), gen.completions),
            (RouteDoc("POST", "/v1/chat/completions", "Chat completion (OpenAI).",
                      req.chat_request(f), res.CHAT_RESPONSE, stream=True, auth=True,
                      errors=(*json_errors, 504)), gen.chat_completions),
            (RouteDoc("GET", "/v1/models", "The served model.", response=res.MODEL_LIST,
                      auth=True, errors=(401,)), models.list_models),
            (RouteDoc("GET", "/v1/models/{model}", "One model by id.", response=res.MODEL_CARD,
                      auth=True, errors=(401, 404), path_params=model), models.get_model),
            (RouteDoc("GET", "/v1/cache/stats", "KV-cache and prefix-cache statistics.",
                      response=res.CACHE_STATS, auth=True, errors=(401,)), cache.cache_stats),
            (RouteDoc("POST", "/v1/cache/warmup", "Start a warm-up job: compute, store and "
                      "pin the KV blocks of shared prefixes (202; poll its status).",
                      req.warmup_request(f), res.WARMUP_STARTED, status=202, auth=True,
                      errors=(400, 401, 413, 429, 503)), cache.cache_warmup),
            (RouteDoc("GET", "/v1/cache/warmup/{id}", "A warm-up job's status and counters.",
                      response=res.WARMUP_JOB, auth=True, errors=(401, 404)),
             cache.cache_warmup_status),
            (RouteDoc("POST", "/v1/cache/flush", "Drop the engine's unreferenced device "
                      "prefix-cache blocks and its host tier (the store keeps its blocks).",
                      response=res.CACHE_FLUSH, auth=True, errors=(401, 429, 503, 504)),
             cache.cache_flush),
            (RouteDoc("POST", "/reset_prefix_cache", "vLLM's name of POST /v1/cache/flush "
                      "(the same key, flush and answer).", response=res.CACHE_FLUSH, auth=True,
                      errors=(401, 429, 503, 504)), cache.cache_flush),
            (RouteDoc("POST", "/tokenize", "Tokenize a prompt or chat messages (vLLM).",
                      req.tokenize_request(f), res.TOKENIZE_RESPONSE, errors=(400, 404, 413)),
             models.tokenize),
            (RouteDoc("POST", "/detokenize", "Token ids to text (vLLM).",
                      req.detokenize_request(f), res.DETOKENIZE_RESPONSE, errors=(400, 404, 413)),
             models.detokenize),
            (RouteDoc("GET", "/health", "Liveness: the process answers.",
                      response=res.HEALTH_RESPONSE), health.health),
            (RouteDoc("GET", "/ready", "Readiness: a worker is up and the gateway is not "
                      "draining.", response=res.READY_RESPONSE,
                      other={503: res.NOT_READY_RESPONSE}), health.ready),
            (RouteDoc("GET", "/metrics", "Prometheus metrics.", content_type="text/plain"),
             health.prometheus),
            (RouteDoc("GET", "/version", "Server version.", response=res.VERSION_RESPONSE),
             health.version),
            (RouteDoc("GET", "/openapi.json", "This document."), self.openapi_json),
        ]  # fmt: skip

    async def openapi_json(self, request: web.Request) -> web.Response:
        return web.json_response(self.openapi)

    def start_draining(self) -> None:
        """/ready turns 503 and new generation requests are refused; running ones go on."""
        self.admission.start_draining()
        log.info("draining", in_flight=self.admission.in_flight)
