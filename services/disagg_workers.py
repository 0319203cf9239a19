"""The prefill and decode workers of the disaggregated topology (see services/disagg.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from kvserve.services.worker import EngineWorker, sampling_params_from_dict
from kvserve.shared.bus import Delivery, WorkerPort, error_event
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.engine.engine import RequestOutput
from kvserve.shared.protocol import ErrorInfo, GenerateRequest
from kvserve.shared.sampling_params import (
    InvalidRequestError,
    SamplingParams,
)
from kvserve.shared.store.hashing import block_hashes
from kvserve.shared.telemetry import (
    GEN_AI_CACHED_TOKENS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_REQUEST_MODEL,
    KVSERVE_CACHED_TOKENS,
    KVSERVE_REQUEST_ID,
    context_from_traceparent,
    current_traceparent,
    get_logger,
    get_tracer,
)
from opentelemetry import trace

wlog = get_logger("kvserve.disagg")
tracer = get_tracer("kvserve.disagg")

Forward = Callable[[GenerateRequest], Awaitable[Any]]


class PrefillWorker(EngineWorker):
    """Prefill side of the handoff (see the module docstring)."""

    def __init__(self, port: WorkerPort, engine: AsyncEngine, forward: Forward, **kw: Any):
        super().__init__(port, engine, **kw)
        self.forward = forward
        self._cached: dict[str, int] = {}  # request id -> prompt tokens found cached

    async def _serve(self, d: Delivery) -> None:
        req = d.request
        assert isinstance(req, GenerateRequest)
        received = time.time()
        try:
            with tracer.start_as_current_span(
                "kvserve.prefill.request",
                context=context_from_traceparent(req.traceparent),
                attributes={
                    KVSERVE_REQUEST_ID: req.request_id,
                    GEN_AI_OPERATION: "generate",
                    GEN_AI_INPUT_TOKENS: len(req.prompt_token_ids),
                    GEN_AI_REQUEST_MODEL: self.model_name or "",
                },
            ):
                queue_span = tracer.start_span(
                    "kvserve.queue", start_time=int(req.submitted_at * 1e9)
                )
                queue_span.end(end_time=int(received * 1e9))
                if await self._prefill(req):
                    fwd = dataclasses.replace(
                        req,
                        traceparent=current_traceparent(),
                        submitted_at=time.time(),
                        num_cached_tokens=self._cached.pop(req.request_id, 0),
                    )
                    await self.forward(fwd)
        except Exception:
            wlog.exception("prefill failed", request_id=req.request_id)
            with contextlib.suppress(Exception):
                await self.port.emit(
                    error_event(req.request_id, 0, ErrorInfo("prefill failed", "server_error"))
                )
        finally:
            self._cached.pop(req.request_id, None)
            with contextlib.suppress(Exception):
                await self.port.ack(d)

    async def _prefill(self, req: GenerateRequest) -> bool:
        """Compute and store the prompt's KV; True when the request goes on to decode."""
        span = trace.get_current_span()
        if await self.port.is_cancelled(req.request_id):
            return False
        if req.deadline is not None and time.time() > req.deadline:
            await self._fail(req, ErrorInfo("request deadline passed before it ran", "timeout"))
            return False
        prompt = list(req.prompt_token_ids)
        try:
            self.engine.engine.validate(prompt, sampling_params_from_dict(req.sampling))
        except InvalidRequestError as e:
            await self._fail(req, ErrorInfo(str(e), "invalid_request_error", e.param))
            return False
        if len(prompt) < 2:
            return True
        local = await self._prefix_match(req, prompt[:-1])
        last: RequestOutput | None = None
        try:
            with tracer.start_as_current_span("kvserve.compute") as compute:
                stream = self.engine.generate(
                    req.request_id,
                    prompt[:-1],
                    SamplingParams(max_tokens=1),
                    cache_salt=req.cache_salt,
                    export_tail=True,
                )
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        last = out
                cached = last.num_cached_tokens if last is not None else 0
                compute.set_attribute(GEN_AI_CACHED_TOKENS, cached)
                compute.set_attribute(KVSERVE_CACHED_TOKENS, cached)
                compute.set_attribute("kvserve.computed_tokens", len(prompt) - 1 - cached)
                compute.set_attribute("kvserve.cached_tokens.store", max(0, cached - local))
        except asyncio.CancelledError:
            wlog.info("prefill cancelled", request_id=req.request_id)
            return False
        span.set_attribute(GEN_AI_CACHED_TOKENS, cached)
        span.set_attribute(KVSERVE_CACHED_TOKENS, cached)
        self._cached[req.request_id] = cached
        tail = last.kv_tail if last is not None else None
        with tracer.start_as_current_span("kvserve.store_publish") as pub:
            pub.set_attribute("kvserve.tail_tokens", len(tail.token_ids) if tail else 0)
            flushed = await asyncio.to_thread(self._publish, req.request_id, tail)
            pub.set_attribute("kvserve.flushed", flushed)
        return True

    async def _prefix_match(self, req: GenerateRequest, prompt: list[int]) -> int:
        """The `kvserve.prefix_match` span: how many of the prompt's full blocks the local
        tiers hold (device cache, then host tier), looked up on the engine thread before the
        compute (which then also asks the store for the rest). Returns the local tokens."""
        eng = self.engine.engine
        bs = eng.block_size

        def lookup() -> tuple[int, int, int]:
            n = (len(prompt) - 1) // bs  # the last token is always computed
            hashes = block_hashes(eng.root_hash(req.cache_salt), prompt[: n * bs], bs)
            device = len(eng.pool.index.match(hashes)) if eng.pool.index is not None else 0
            host = 0
            if eng.host_tier is not None:
                while device + host < n and hashes[device + host] in eng.host_tier:
                    host += 1
            return n, device, host

        with tracer.start_as_current_span(
            "kvserve.prefix_match", attributes={KVSERVE_REQUEST_ID: req.request_id}
        ) as span:
            n, device, host = await self.engine.call(lookup)
            span.set_attribute("kvserve.prefix.full_blocks", n)
            span.set_attribute("kvserve.cached_tokens.device", device * bs)
            span.set_attribute("kvserve.cached_tokens.host", host * bs)
            span.set_attribute(KVSERVE_CACHED_TOKENS, (device + host) * bs)
            span.set_attribute(GEN_AI_CACHED_TOKENS, (device + host) * bs)
        return (device + host) * bs

    def _publish(self, request_id: str, tail: Any) -> bool:
        conn = self.engine.engine.connector
        if conn is None:
            return False
        if tail is not None:
            conn.put_tail(request_id, tail)
        return bool(conn.flush())

    async def _fail(self, req: GenerateRequest, info: ErrorInfo) -> None:
        await self.port.emit(error_event(req.request_id, 0, info))


class DecodeWorker(EngineWorker):
    """Decode side: the serve worker, with the prefilled tail fetched from the store."""

    def _generate(
        self, req: GenerateRequest, params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        return self._with_tail(req, params)

    async def _with_tail(
        self, req: GenerateRequest, params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        prompt = list(req.prompt_token_ids)
        eng = self.engine.engine
        tail = None
        head = len(prompt) - 1
        full = head // eng.block_size * eng.block_size
        if eng.connector is not None and full < head:
            with tracer.start_as_current_span("kvserve.store_fetch") as fetch:
                fetch.set_attribute(KVSERVE_REQUEST_ID, req.request_id)
                fetch.set_attribute("kvserve.tail_tokens", head - full)
                tail = await asyncio.wrap_future(
                    eng.connector.get_tail(req.request_id, prompt[full:head])
                )
                fetch.set_attribute("kvserve.tail_found", tail is not None)
        stream = self.engine.generate(
            req.request_id, prompt, params, cache_salt=req.cache_salt, kv_tail=tail
        )
        reported = req.num_cached_tokens  # what prefill found cached: what the client sees
        async with contextlib.aclosing(stream):
            async for out in stream:
                if reported is not None:
                    out = dataclasses.replace(out, num_cached_tokens=min(reported, len(prompt)))
                yield out
