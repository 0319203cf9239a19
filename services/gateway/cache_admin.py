"""The cache admin routes: GET /v1/cache/stats (the gateway's, the workers' and the router's
counters), POST /v1/cache/warmup and GET /v1/cache/warmup/{id} (warm-up jobs run by a worker),
POST /v1/cache/flush (drop the workers' unreferenced device blocks and host tier; also at vLLM's
POST /reset_prefix_cache, which benchmark clients such as aiperf call)."""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

from aiohttp import web
from kvserve.services.gateway.context import GatewayContext
from kvserve.services.gateway.errors import APIError, bad_request, from_worker
from kvserve.services.gateway.middleware import TENANT_SALT
from kvserve.services.gateway.prefixes import check_prefix, prefix_ids
from kvserve.services.gateway.warmup_jobs import WarmupJob, WarmupJobs
from kvserve.shared.model.tokenizer import ChatTemplateError
from kvserve.shared.protocol import AdminRequest
from kvserve.shared.telemetry import current_traceparent, get_logger

log = get_logger("kvserve.gateway")

# The workers' counters that /v1/cache/stats sums into its totals.
STAT_TOTALS = ("num_requests_running", "num_requests_waiting", "num_blocks", "num_used_blocks",
               "cached_blocks", "evicted_blocks", "prefix_cache_queries", "prefix_cache_hits",
               "num_preemptions", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
               "spec_decode_num_accepted_tokens")  # fmt: skip


class CacheAdmin:
    """Owns the warm-up jobs (`warmups`): the running ones and the latest finished ones;
    `cancel_warmups` stops the running ones when the app shuts down."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx
        self.warmups = WarmupJobs(ctx.config.max_warmup_jobs)

    async def cache_stats(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        workers = await ctx.bus.stats()
        totals: dict[str, float] = {
            k: sum(_count(s.get(k)) for s in workers.values()) for k in STAT_TOTALS
        }
        q = totals["prefix_cache_queries"]
        totals["prefix_cache_hit_rate"] = totals["prefix_cache_hits"] / q if q else 0.0
        return web.json_response(
            {
                "object": "cache.stats",
                "gateway": {
                    "in_flight": ctx.admission.in_flight,
                    "max_in_flight": ctx.admission.max_in_flight,
                    "draining": ctx.admission.draining,
                    "bus_dropped": ctx.bus.dropped(),
                },
                "totals": totals,
                "workers": workers,
                "router": ctx.routing.stats() if ctx.routing is not None else None,
            }
        )

    async def cache_warmup(self, request: web.Request) -> web.Response:
        """Validate and tokenize the prefixes here (as `kvserve warmup FILE` does), then hand
        the job to a worker over the bus; its events update the job's status."""
        body = await self.ctx.json_body(request)
        items = self._warmup_items(body.get("prefixes"), request.get(TENANT_SALT))
        await self.ctx.readiness.require_worker()
        job = WarmupJob("warmup-" + uuid.uuid4().hex, len(items))
        msg = AdminRequest(job.id, "warmup", items, traceparent=current_traceparent())
        self.warmups.start(job, await self.ctx.bus.submit(msg))
        log.info("warm-up job started", job=job.id, prefixes=len(items))
        return web.json_response(
            {"id": job.id, "object": "cache.warmup", "status": job.status, "total": job.total},
            status=202,
        )

    def _warmup_items(self, prefixes: Any, tenant: str | None) -> list[dict[str, Any]]:
        """The job's items (token ids and cache salt per prefix); 400 for a bad prefix."""
        if not isinstance(prefixes, list) or not prefixes:
            raise bad_request("'prefixes' must be a non-empty list", "prefixes")
        items: list[dict[str, Any]] = []
        for i, p in enumerate(prefixes):
            error = check_prefix(p)
            if error is not None:
                raise bad_request(f"prefixes[{i}]: {error}", "prefixes")
            salt = self.ctx.keys.effective_salt(tenant, p.get("cache_salt"))
            try:
                ids = prefix_ids(self.ctx.model.tokenizer, p)
            except (ChatTemplateError, TypeError, ValueError) as e:
                raise bad_request(f"prefixes[{i}]: {e}", "prefixes") from e
            items.append({"token_ids": ids, "cache_salt": salt})
        return items

    async def cancel_warmups(self, app: web.Application) -> None:
        await self.warmups.cancel()

    async def cache_warmup_status(self, request: web.Request) -> web.Response:
        job = self.warmups.get(request.match_info["id"])
        if job is None:
            raise APIError(404, "No such warm-up job.", "not_found_error", "id", "not_found")
        return web.json_response(job.view())

    async def cache_flush(self, request: web.Request) -> web.Response:
        """Flush every routed worker's cache (each on its own stream), or one worker's when
        requests go to the shared stream."""
        await self.ctx.readiness.require_worker()
        routing = self.ctx.routing
        targets: list[str | None] = [*routing.targets()] if routing else []
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
        stream = await self.ctx.bus.submit(msg, worker)
        try:
            async with asyncio.timeout(self.ctx.config.request_timeout_s), stream:
                async for ev in stream:
                    if ev.error is not None:
                        raise from_worker(ev.error)
                    info.update(ev.info or {})
        except TimeoutError:
            raise APIError(504, "the flush timed out", "timeout", None, "timeout") from None
        return info


def _count(value: object) -> int:
    """A count from a worker's report (untrusted): 0 for anything but a number."""
    return int(value) if isinstance(value, int | float) and math.isfinite(value) else 0
