"""Cache admin jobs on a worker's engine: warm-up (compute, store and pin shared prefixes) and
flush (drop the engine's unreferenced prefix-cache blocks and its host tier).

A job answers on the bus like a request: numbered events whose `info` carries the job's
counters, the last with finish_reason "stop"; or an error event if the job fails or is
cancelled. A warm-up emits one event per prefix, with the running counters."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kvserve.shared.bus.base import WorkerPort
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.protocol import AdminRequest, ErrorInfo, TokenEvent, error_event
from kvserve.shared.sampling_params import InvalidRequestError
from kvserve.shared.telemetry import (
    KVSERVE_REQUEST_ID,
    context_from_traceparent,
    get_logger,
    get_tracer,
)

log = get_logger("kvserve.worker")
tracer = get_tracer("kvserve.worker")

WARMUP_COUNTERS = ("blocks", "computed", "skipped", "published")


class _JobEvents:
    """The job's events, numbered 0, 1, 2, ..."""

    def __init__(self, port: WorkerPort, request_id: str) -> None:
        self.port = port
        self.request_id = request_id
        self.seq = 0

    async def emit(self, info: dict[str, Any], finish: str | None = None) -> None:
        event = TokenEvent(self.request_id, self.seq, info=info, finish_reason=finish)
        await self.port.emit(event)
        self.seq += 1

    async def error(self, info: ErrorInfo) -> None:
        """The terminal error event; a bus that fails here is not this job's problem."""
        with contextlib.suppress(Exception):
            await self.port.emit(error_event(self.request_id, self.seq, info))


async def run_admin_job(port: WorkerPort, engine: AsyncEngine, job: AdminRequest) -> None:
    """Run one job to its end; failures and cancellation become its error event."""
    events = _JobEvents(port, job.request_id)
    try:
        with tracer.start_as_current_span(
            f"kvserve.cache.{job.op}",
            context=context_from_traceparent(job.traceparent),
            attributes={KVSERVE_REQUEST_ID: job.request_id},
        ):
            if job.op == "flush":
                await _flush(port, engine, events)
            else:
                await _warmup(engine, job, events)
    except InvalidRequestError as e:
        await events.error(ErrorInfo(str(e), "invalid_request_error", e.param))
    except asyncio.CancelledError:
        await events.error(ErrorInfo("job cancelled", "cancelled"))
    except Exception as e:
        log.exception("admin job failed", request_id=job.request_id, op=job.op)
        await events.error(ErrorInfo(f"{job.op} failed: {e}", "server_error"))


async def _flush(port: WorkerPort, engine: AsyncEngine, events: _JobEvents) -> None:
    got = await engine.reset_prefix_cache()
    await events.emit({**got, "worker": port.name}, "stop")
    log.info("prefix cache flushed", **got)


async def _warmup(engine: AsyncEngine, job: AdminRequest, events: _JobEvents) -> None:
    """Each prefix on the engine thread in turn; an event with the running counters after
    each (an empty job: one final event)."""
    total = len(job.prefixes)
    counts = {"done": 0, "total": total, **dict.fromkeys(WARMUP_COUNTERS, 0)}
    for i, p in enumerate(job.prefixes):
        got = await engine.warmup(p["token_ids"], p.get("cache_salt"), f"{job.request_id}-{i}")
        for k in WARMUP_COUNTERS:
            counts[k] += int(got[k])
        counts["done"] = i + 1
        await events.emit(dict(counts), "stop" if i + 1 == total else None)
    if not total:
        await events.emit(counts, "stop")
