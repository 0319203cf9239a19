"""What every request passes through before and after its handler: the error middleware (any
failure becomes an error in OpenAI's shape, counted by route and status), the auth middleware
(bearer key -> the tenant's cache salt on /v1 and KEYED_ALIASES, then the per-key rate limit on
POST), and the JSON body reader (size limit, a JSON object or 400).

Invariants: a handler's `APIError` and aiohttp's own HTTP errors (404, 405 with its Allow
header, 413) answer with the OpenAI error body; anything else is logged and answers 500;
client disconnects and cancellation propagate untouched."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.config import GatewayConfig
from kvserve.services.gateway.errors import APIError, bad_request
from kvserve.services.gateway.ratelimit import RateLimiter
from kvserve.shared.telemetry import Metrics, get_logger

log = get_logger("kvserve.gateway")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TENANT_SALT: web.RequestKey[str] = web.RequestKey("tenant_salt", str)  # set by auth on /v1
# Paths outside /v1 that the bearer key and the rate limit guard as they guard /v1: vLLM's
# names of /v1 routes (POST /reset_prefix_cache is POST /v1/cache/flush).
KEYED_ALIASES = frozenset({"/reset_prefix_cache"})

REJECT_REASONS = {
    401: "unauthorized",
    413: "body_too_large",
    429: "rate_limited",
    503: "unavailable",
}


class Middleware:
    """The app's two middlewares, `errors` (outermost) then `auth`. The rate limiter's
    buckets are its only state (None without a rate limit)."""

    def __init__(self, config: GatewayConfig, metrics: Metrics, keys: ApiKeys) -> None:
        self.config = config
        self.metrics = metrics
        self.keys = keys
        self.limiter = RateLimiter(config.rate_limit) if config.rate_limit > 0 else None

    @web.middleware
    async def errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
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
            self.metrics.rejected.labels(REJECT_REASONS.get(resp.status, str(resp.status))).inc()
        return resp

    @web.middleware
    async def auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") or request.path in KEYED_ALIASES:
            salt = self.keys.authenticate(request.headers.get("Authorization"))
            if salt is not None:
                request[TENANT_SALT] = salt
            if self.limiter is not None and request.method == "POST":
                self._rate_limit(
                    self.limiter, salt if salt is not None else f"addr:{request.remote}"
                )
        return await handler(request)

    def _rate_limit(self, limiter: RateLimiter, key: str) -> None:
        wait = limiter.acquire(key)
        if wait > 0:
            raise APIError(
                429,
                f"Rate limit of {self.config.rate_limit:g} requests per second exceeded; "
                "retry later.",
                "rate_limit_error",
                None,
                "rate_limit_exceeded",
                headers={"Retry-After": str(limiter.retry_after(wait))},
            )


async def json_body(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The request's body as a JSON object; 413 over `max_bytes`, 400 for anything else."""
    if (request.content_length or 0) > max_bytes:
        raise web.HTTPRequestEntityTooLarge(
            max_size=max_bytes, actual_size=request.content_length or 0
        )
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"The body is not valid JSON: {e}", None, "invalid_json") from e
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.", None, "invalid_json")
    return body
