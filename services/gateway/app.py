"""The OpenAI-compatible gateway (aiohttp). Talks only to the bus; never imports torch.

Request path: auth (bearer key -> tenant cache salt) -> body (size limit, JSON) -> schema
(validate, tokenize, chat template) -> admission (bounded in-flight, draining) -> route (with
`GatewayConfig.routing`: the worker that holds most of the prompt's KV for its load) -> bus (one
request per prompt) -> events -> response (JSON, or SSE chunks and `data: [DONE]`).

Invariants:
- A request that leaves the handler before all its events arrived (client gone, deadline,
  error) is cancelled on the bus, so the worker aborts it and frees its blocks.
- An error before the first token is an HTTP error with the OpenAI shape; after the stream has
  started it is an SSE error event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from kvserve.services.gateway import openapi as doc
from kvserve.services.gateway.admission import Admission
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.errors import APIError, bad_request, from_worker, sse_error
from kvserve.services.gateway.generation import BusGeneration
from kvserve.services.gateway.openapi import ApiFacts, RouteDoc, build_openapi
from kvserve.services.gateway.prefixes import check_prefix, prefix_ids
from kvserve.services.gateway.ratelimit import RateLimiter
from kvserve.services.gateway.responses import SSE_DONE, ResponseBuilder, sse
from kvserve.services.gateway.router import Router
from kvserve.services.gateway.routing import RoutingService
from kvserve.services.gateway.schema import (
    GenerationPlan,
    ModelInfo,
    check_model,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from kvserve.services.gateway.warmup_jobs import WarmupJob, WarmupJobs
from kvserve.shared.bus.base import Bus, BusUnavailableError
from kvserve.shared.model.tokenizer import ChatTemplateError
from kvserve.shared.protocol import AdminRequest, TokenEvent
from kvserve.shared.telemetry import (
    GEN_AI_CACHED_TOKENS,
    GEN_AI_CHOICE_COUNT,
    GEN_AI_FINISH_REASONS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_MAX_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_RESPONSE_ID,
    GEN_AI_RESPONSE_MODEL,
    GEN_AI_SEED,
    GEN_AI_SYSTEM,
    GEN_AI_TEMPERATURE,
    GEN_AI_TOP_P,
    KVSERVE_CACHED_TOKENS,
    KVSERVE_CACHED_TOKENS_TIER,
    KVSERVE_REQUEST_ID,
    KVSERVE_STORE_LOOKUP,
    Metrics,
    context_from_traceparent,
    current_traceparent,
    get_logger,
    get_tracer,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

VERSION = "0.1.0"
log = get_logger("kvserve.gateway")
tracer = get_tracer("kvserve.gateway")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
TENANT_SALT: web.RequestKey[str] = web.RequestKey("tenant_salt", str)  # set by auth on /v1


@dataclass(frozen=True)
class GatewayConfig:
    max_in_flight: int = 256
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 600.0
    api_keys: tuple[str, ...] = ()
    allow_client_cache_salt: bool = False
    retry_after_s: int = 1
    rate_limit: float = 0.0  # requests per second per API key on POST /v1 (0: no limit)
    max_warmup_jobs: int = 100  # finished warm-up jobs remembered for their status endpoint
    # The router (services/gateway/router.py): a policy, or None (no routing: `kvserve serve`)
    routing: str | None = None
    overlap_weight: float = 1.0
    router_store_cost: float = 0.2
    router_max_blocks: int = 100_000


class Gateway:
    def __init__(self, config: GatewayConfig, bus: Bus, model: ModelInfo) -> None:
        self.config = config
        self.bus = bus
        self.model = model
        self.metrics = Metrics(model.name)
        self.admission = Admission(config.max_in_flight, config.retry_after_s)
        self.metrics.in_flight.set_function(lambda: self.admission.in_flight)
        self.keys = ApiKeys(config.api_keys, config.allow_client_cache_salt)
        self.started_at = int(time.time())
        self.limiter = RateLimiter(config.rate_limit) if config.rate_limit > 0 else None
        self.warmups = WarmupJobs(config.max_warmup_jobs)
        self.app = web.Application(
            client_max_size=config.max_body_bytes, middlewares=[self._errors, self._auth]
        )
        facts = ApiFacts.of(model, self.keys.enabled, config.allow_client_cache_salt)
        self.routes = self._routes(facts)
        for r, handler in self.routes:
            self.app.router.add_route(r.method, r.path, handler)
        self.openapi = build_openapi([r for r, _ in self.routes], "kvserve", VERSION, facts)
        self.app.on_cleanup.append(self._cancel_warmups)
        self.routing = self._routing()

    def _routing(self) -> RoutingService | None:
        """The router, started and stopped with the app (None without a routing policy)."""
        c = self.config
        if c.routing is None:
            return None
        router = Router(c.routing, c.overlap_weight, c.router_max_blocks, c.router_store_cost)
        routing = RoutingService(self.bus, router, self.metrics.registry)

        async def start(_app: web.Application) -> None:
            await routing.start()

        async def stop(_app: web.Application) -> None:
            await routing.stop()

        self.app.on_startup.append(start)
        self.app.on_cleanup.append(stop)
        return routing

    def _routes(self, f: ApiFacts) -> list[tuple[RouteDoc, Handler]]:
        json_errors = (400, 401, 404, 413, 429, 503)
        model = {"model": doc.model_schema(f)}
        return [
            (RouteDoc("POST", "/v1/completions", "Text completion (OpenAI).",
                      doc.completion_request(f), doc.COMPLETION_RESPONSE, stream=True, auth=True,
                      errors=(*json_errors, 504)), self.completions),
            (RouteDoc("POST", "/v1/chat/completions", "Chat completion (OpenAI).",
                      doc.chat_request(f), doc.CHAT_RESPONSE, stream=True, auth=True,
                      errors=(*json_errors, 504)), self.chat_completions),
            (RouteDoc("GET", "/v1/models", "The served model.", response=doc.MODEL_LIST,
                      auth=True, errors=(401,)), self.list_models),
            (RouteDoc("GET", "/v1/models/{model}", "One model by id.", response=doc.MODEL_CARD,
                      auth=True, errors=(401, 404), path_params=model), self.get_model),
            (RouteDoc("GET", "/v1/cache/stats", "KV-cache and prefix-cache statistics.",
                      response=doc.CACHE_STATS, auth=True, errors=(401,)), self.cache_stats),
            (RouteDoc("POST", "/v1/cache/warmup", "Start a warm-up job: compute, store and "
                      "pin the KV blocks of shared prefixes (202; poll its status).",
                      doc.warmup_request(f), doc.WARMUP_STARTED, status=202, auth=True,
                      errors=(400, 401, 413, 429, 503)), self.cache_warmup),
            (RouteDoc("GET", "/v1/cache/warmup/{id}", "A warm-up job's status and counters.",
                      response=doc.WARMUP_JOB, auth=True, errors=(401, 404)),
             self.cache_warmup_status),
            (RouteDoc("POST", "/v1/cache/flush", "Drop the engine's unreferenced device "
                      "prefix-cache blocks and its host tier (the store keeps its blocks).",
                      response=doc.CACHE_FLUSH, auth=True, errors=(401, 429, 503, 504)),
             self.cache_flush),
            (RouteDoc("POST", "/tokenize", "Tokenize a prompt or chat messages (vLLM).",
                      doc.tokenize_request(f), doc.TOKENIZE_RESPONSE, errors=(400, 404, 413)),
             self.tokenize),
            (RouteDoc("POST", "/detokenize", "Token ids to text (vLLM).",
                      doc.detokenize_request(f), doc.DETOKENIZE_RESPONSE, errors=(400, 404, 413)),
             self.detokenize),
            (RouteDoc("GET", "/health", "Liveness: the process answers.",
                      response=doc.HEALTH_RESPONSE), self.health),
            (RouteDoc("GET", "/ready", "Readiness: a worker is up and the gateway is not "
                      "draining.", response=doc.READY_RESPONSE,
                      other={503: doc.NOT_READY_RESPONSE}), self.ready),
            (RouteDoc("GET", "/metrics", "Prometheus metrics.", content_type="text/plain"),
             self.prometheus),
            (RouteDoc("GET", "/version", "Server version.", response=doc.VERSION_RESPONSE),
             self.version),
            (RouteDoc("GET", "/openapi.json", "This document."), self.openapi_json),
        ]  # fmt: skip

    # ---- middleware -----------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        try:
            resp = await handler(request)
        except APIError as e:
            resp = e.response()
        except web.HTTPRequestEntityTooLarge:
            resp = APIError(
                413,
                f"Request body exceeds the limit of {self.config.max_body_bytes} bytes.",
                "invalid_request_error",
                None,
                "request_too_large",
            ).response()
        except web.HTTPException as e:
            resp = APIError(
                e.status,
                e.reason or "error",
                "not_found_error" if e.status == 404 else "invalid_request_error",
                None,
                "not_found" if e.status == 404 else None,
                headers={k: v for k, v in e.headers.items() if k == "Allow"},
            ).response()
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error", path=request.path)
            resp = APIError(500, "Internal server error.", "server_error").response()
        self.metrics.http_requests.labels(name, str(resp.status)).inc()
        if resp.status in (401, 413, 429, 503):
            self.metrics.rejected.labels(_REJECT_REASON.get(resp.status, str(resp.status))).inc()
        return resp

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            salt = self.keys.authenticate(request.headers.get("Authorization"))
            if salt is not None:
                request[TENANT_SALT] = salt
            if self.limiter is not None and request.method == "POST":
                self._rate_limit(salt if salt is not None else f"addr:{request.remote}")
        return await handler(request)

    def _rate_limit(self, key: str) -> None:
        assert self.limiter is not None
        wait = self.limiter.acquire(key)
        if wait > 0:
            raise APIError(
                429,
                f"Rate limit of {self.config.rate_limit:g} requests per second exceeded; "
                "retry later.",
                "rate_limit_error",
                None,
                "rate_limit_exceeded",
                headers={"Retry-After": str(self.limiter.retry_after(wait))},
            )

    async def _json(self, request: web.Request) -> dict[str, Any]:
        if (request.content_length or 0) > self.config.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=self.config.max_body_bytes, actual_size=request.content_length or 0
            )
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad_request(f"The body is not valid JSON: {e}", None, "invalid_json") from e
        if not isinstance(body, dict):
            raise bad_request("The body must be a JSON object.", None, "invalid_json")
        return body

    # ---- generation -----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        plan = parse_completion(await self._json(request), self.model)
        return await self._generate(request, plan)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        plan = parse_chat(await self._json(request), self.model)
        return await self._generate(request, plan)

    async def _generate(self, request: web.Request, plan: GenerationPlan) -> web.StreamResponse:
        salt = self.keys.effective_salt(request.get(TENANT_SALT), plan.cache_salt)
        await self._require_worker()
        with self.admission.admit():
            return await self._handle_generation(request, plan, salt)

    async def _readiness(self) -> str:
        """ready, starting (no live worker) or bus_unavailable (Redis down: nobody can tell)."""
        try:
            return "ready" if await self.bus.ready() else "starting"
        except BusUnavailableError:
            return "bus_unavailable"

    async def _require_worker(self) -> None:
        status = await self._readiness()
        if status != "ready":
            bus_down = status == "bus_unavailable"
            raise APIError(
                503,
                "The event bus (Redis) is unreachable; retry shortly."
                if bus_down
                else "No engine worker is ready yet; retry shortly.",
                "server_error",
                None,
                "bus_unavailable" if bus_down else "not_ready",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )

    async def _handle_generation(
        self, request: web.Request, plan: GenerationPlan, salt: str | None
    ) -> web.StreamResponse:
        """The whole life of an admitted generation request: its server span and log context,
        the bus requests, the response (JSON or SSE), then cancels, metrics and the span's
        usage attributes, whatever way it ends."""
        op = "chat" if plan.kind == "chat" else "text_completion"
        rid = ("chatcmpl-" if plan.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        with (
            tracer.start_as_current_span(
                f"{op} {plan.model}",
                context=context_from_traceparent(request.headers.get("traceparent")),
                kind=SpanKind.SERVER,
                attributes=_request_attributes(op, plan, rid),
            ) as span,
            structlog.contextvars.bound_contextvars(request_id=rid),
        ):
            call = BusGeneration(
                self.bus, plan, rid, salt, self.config.request_timeout_s, self.metrics,
                self.model.name, routing=self.routing,
            )  # fmt: skip
            builder = ResponseBuilder(plan, rid, self.model.tokenizer, plan.model)
            status = "error"
            try:
                await call.submit()
                if plan.stream:
                    resp = await self._stream(request, call, builder)
                else:
                    resp = await self._complete(call, builder)
                status = call.error_type or ("ok" if call.all_done else "incomplete")
                return resp
            except APIError as e:
                span.set_status(Status(StatusCode.ERROR, e.message))
                status = e.type
                raise
            finally:
                await call.close()
                self._finish(span, call, builder, status)

    async def _complete(self, call: BusGeneration, builder: ResponseBuilder) -> web.Response:
        try:
            async with asyncio.timeout_at(call.deadline), contextlib.aclosing(call.events()) as ev:
                async for p, event in ev:
                    if event.error is not None:
                        raise from_worker(event.error)
                    builder.add(p, event)
        except TimeoutError:
            raise call.timeout_error() from None
        return web.json_response(builder.final())

    async def _stream(
        self, request: web.Request, call: BusGeneration, builder: ResponseBuilder
    ) -> web.StreamResponse:
        async with contextlib.aclosing(call.events()) as events:
            # Wait for the first event before answering 200: an error up to here is a plain
            # HTTP error (for example a request the worker's KV cache can never hold).
            try:
                async with asyncio.timeout_at(call.deadline):
                    first = await anext(events)
            except TimeoutError:
                raise call.timeout_error() from None
            except StopAsyncIteration:
                raise APIError(500, "the request ended without output", "server_error") from None
            if first[1].error is not None:
                raise from_worker(first[1].error)
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            try:
                for chunk in builder.opening_chunks():
                    await resp.write(sse(chunk))
                await resp.write(sse(builder.event_chunk(*first)))
                await self._stream_rest(resp, call, builder, events)
                await resp.write(SSE_DONE)
                await resp.write_eof()
            except ConnectionResetError:
                log.info("client went away mid-stream")
        return resp

    async def _stream_rest(
        self,
        resp: web.StreamResponse,
        call: BusGeneration,
        builder: ResponseBuilder,
        events: AsyncIterator[tuple[int, TokenEvent]],
    ) -> None:
        try:
            async with asyncio.timeout_at(call.deadline):
                async for p, event in events:
                    if event.error is not None:
                        await resp.write(sse_error(from_worker(event.error)))
                        return
                    await resp.write(sse(builder.event_chunk(p, event)))
        except TimeoutError:
            await resp.write(sse_error(call.timeout_error()))
            return
        if builder.plan.include_usage:
            await resp.write(sse(builder.usage_chunk()))

    def _finish(
        self, span: Span, call: BusGeneration, builder: ResponseBuilder, status: str
    ) -> None:
        usage = builder.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        span.set_attribute(GEN_AI_RESPONSE_ID, builder.id)
        span.set_attribute(GEN_AI_RESPONSE_MODEL, builder.model)
        span.set_attribute(GEN_AI_INPUT_TOKENS, usage["prompt_tokens"])
        span.set_attribute(GEN_AI_OUTPUT_TOKENS, usage["completion_tokens"])
        span.set_attribute(GEN_AI_CACHED_TOKENS, cached)
        span.set_attribute(KVSERVE_CACHED_TOKENS, cached)
        for tier, n in usage["prompt_tokens_details"]["cached_tokens_by_tier"].items():
            span.set_attribute(KVSERVE_CACHED_TOKENS_TIER + tier, n)
        if builder.store_lookup is not None:
            span.set_attribute(KVSERVE_STORE_LOOKUP, builder.store_lookup)
        span.set_attribute(GEN_AI_FINISH_REASONS, builder.finish_reasons)
        m, name = self.metrics, self.model.name
        elapsed = time.monotonic() - call.t0
        if status == "ok":
            m.e2e.labels(name).observe(elapsed)
            m.prompt_tokens.labels(name).inc(usage["prompt_tokens"])
            m.generation_tokens.labels(name).inc(usage["completion_tokens"])
            m.cached_prompt_tokens.labels(name).inc(cached)
            m.prompt_tokens_hist.labels(name).observe(usage["prompt_tokens"])
            m.generation_tokens_hist.labels(name).observe(usage["completion_tokens"])
            for reason in builder.finish_reasons:
                m.request_success.labels(name, reason).inc()
        log.info(
            "request finished",
            status=status,
            kind=builder.plan.kind,
            stream=builder.plan.stream,
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            cached_tokens=cached,
            ttft_s=None if call.first_token_at is None else round(call.first_token_at, 4),
            e2e_s=round(elapsed, 4),
        )

    # ---- other routes ---------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model.name,
            "object": "model",
            "created": self.started_at,
            "owned_by": "kvserve",
            "root": self.model.path,
            "parent": None,
            "max_model_len": self.model.max_model_len,
        }

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: web.Request) -> web.Response:
        check_model({"model": request.match_info["model"]}, self.model)
        return web.json_response(self._model_card())

    async def cache_stats(self, request: web.Request) -> web.Response:
        workers = await self.bus.stats()
        keys = ("num_requests_running", "num_requests_waiting", "num_blocks", "num_used_blocks",
                "cached_blocks", "evicted_blocks", "prefix_cache_queries", "prefix_cache_hits",
                "num_preemptions")  # fmt: skip
        totals: dict[str, float] = {
            k: sum(int(s.get(k, 0)) for s in workers.values()) for k in keys
        }
        q = totals["prefix_cache_queries"]
        totals["prefix_cache_hit_rate"] = totals["prefix_cache_hits"] / q if q else 0.0
        return web.json_response(
            {
                "object": "cache.stats",
                "gateway": {
                    "in_flight": self.admission.in_flight,
                    "max_in_flight": self.admission.max_in_flight,
                    "draining": self.admission.draining,
                },
                "totals": totals,
                "workers": workers,
                "router": self.routing.stats() if self.routing is not None else None,
            }
        )

    # ---- cache admin: warm-up jobs, flush --------------------------------------------------

    async def cache_warmup(self, request: web.Request) -> web.Response:
        """Validate and tokenize the prefixes here (as `kvserve warmup FILE` does), then hand
        the job to a worker over the bus; its events update the job's status."""
        body = await self._json(request)
        prefixes = body.get("prefixes")
        if not isinstance(prefixes, list) or not prefixes:
            raise bad_request("'prefixes' must be a non-empty list", "prefixes")
        tenant = request.get(TENANT_SALT)
        items: list[dict[str, Any]] = []
        for i, p in enumerate(prefixes):
            error = check_prefix(p)
            if error is not None:
                raise bad_request(f"prefixes[{i}]: {error}", "prefixes")
            salt = self.keys.effective_salt(tenant, p.get("cache_salt"))
            try:
                ids = prefix_ids(self.model.tokenizer, p)
            except (ChatTemplateError, TypeError, ValueError) as e:
                raise bad_request(f"prefixes[{i}]: {e}", "prefixes") from e
            items.append({"token_ids": ids, "cache_salt": salt})
        await self._require_worker()
        job = WarmupJob("warmup-" + uuid.uuid4().hex, len(items))
        msg = AdminRequest(job.id, "warmup", items, traceparent=current_traceparent())
        self.warmups.start(job, await self.bus.submit(msg))
        log.info("warm-up job started", job=job.id, prefixes=len(items))
        return web.json_response(
            {"id": job.id, "object": "cache.warmup", "status": job.status, "total": job.total},
            status=202,
        )

    async def _cancel_warmups(self, app: web.Application) -> None:
        await self.warmups.cancel()

    async def cache_warmup_status(self, request: web.Request) -> web.Response:
        job = self.warmups.get(request.match_info["id"])
        if job is None:
            raise APIError(404, "No such warm-up job.", "not_found_error", "id", "not_found")
        return web.json_response(job.view())

    async def cache_flush(self, request: web.Request) -> web.Response:
        """Flush every routed worker's cache (each on its own stream), or one worker's when
        requests go to the shared stream."""
        await self._require_worker()
        targets: list[str | None] = [*self.routing.targets()] if self.routing else []
        infos = [await self._flush_one(worker) for worker in targets or [None]]
        log.info("prefix cache flushed", workers=len(infos))
        return web.json_response(
            {
                "object": "cache.flush",
                "flushed": True,
                "workers": [i["worker"] for i in infos if "worker" in i],
                "device_blocks": sum(int(i.get("device_blocks", 0)) for i in infos),
                "host_blocks": sum(int(i.get("host_blocks", 0)) for i in infos),
            }
        )

    async def _flush_one(self, worker: str | None) -> dict[str, Any]:
        msg = AdminRequest("flush-" + uuid.uuid4().hex, "flush", [], current_traceparent())
        info: dict[str, Any] = {}
        stream = await self.bus.submit(msg, worker)
        try:
            async with asyncio.timeout(self.config.request_timeout_s), stream:
                async for ev in stream:
                    if ev.error is not None:
                        raise from_worker(ev.error)
                    info.update(ev.info or {})
        except TimeoutError:
            raise APIError(504, "the flush timed out", "timeout", None, "timeout") from None
        return info

    async def tokenize(self, request: web.Request) -> web.Response:
        ids, token_strs = parse_tokenize(await self._json(request), self.model)
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.model.max_model_len,
            "tokens": ids,
        }
        if token_strs:
            out["token_strs"] = [self.model.tokenizer.id_to_token(t) for t in ids]
        return web.json_response(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        ids = parse_detokenize(await self._json(request), self.model)
        return web.json_response({"prompt": self.model.tokenizer.decode(ids)})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if self.admission.draining:
            return web.json_response({"status": "draining"}, status=503)
        status = await self._readiness()
        return web.json_response({"status": status}, status=200 if status == "ready" else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        with contextlib.suppress(Exception):  # a bus hiccup must not fail the scrape
            self.metrics.engine.snapshot = await self.bus.stats()
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION, "model": self.model.name})

    async def openapi_json(self, request: web.Request) -> web.Response:
        return web.json_response(self.openapi)

    # ---- shutdown -------------------------------------------------------------------------

    def start_draining(self) -> None:
        """/ready turns 503 and new generation requests are refused; running ones go on."""
        self.admission.start_draining()
        log.info("draining", in_flight=self.admission.in_flight)


def _request_attributes(op: str, plan: GenerationPlan, rid: str) -> dict[str, AttributeValue]:
    """The server span's GenAI request attributes."""
    p = plan.params
    attrs: dict[str, AttributeValue] = {
        GEN_AI_OPERATION: op,
        GEN_AI_SYSTEM: "kvserve",
        GEN_AI_REQUEST_MODEL: plan.model,
        GEN_AI_MAX_TOKENS: p.max_tokens,
        GEN_AI_TEMPERATURE: p.temperature,
        GEN_AI_TOP_P: p.top_p,
        GEN_AI_CHOICE_COUNT: p.n,
        KVSERVE_REQUEST_ID: rid,
    }
    if p.seed is not None:
        attrs[GEN_AI_SEED] = p.seed
    return attrs


_REJECT_REASON = {
    401: "unauthorized",
    413: "body_too_large",
    429: "rate_limited",
    503: "unavailable",
}
