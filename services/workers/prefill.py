"""PrefillWorker: the prefill side of the disaggregated topology (DESIGN.md section 2).

It reads generate requests from the `kvserve:prefill` consumer group, runs the prompt minus its
last token (max_tokens=1, `export_tail`), puts the partial last block under the request's tail
key, flushes the store writes (so every full block is stored), then forwards the same request
(traceparent now its own span, `num_cached_tokens` what it found cached and
`cached_tokens_by_source` the tiers those came from) to the decode stream.
It never sends a token to the client, only an error event when the request fails here; it acks a
request only once forwarded (or failed/cancelled), so a prefill worker that dies leaves its
requests pending for another one (XAUTOCLAIM).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvserve.services.workers.engine_worker import EngineWorker
from kvserve.services.workers.spans import request_span, set_cache_sources, set_cached_tokens
from kvserve.shared.bus.base import Delivery, WorkerPort, is_bus_error
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.engine.outputs import RequestOutput
from kvserve.shared.protocol import ErrorInfo, GenerateRequest, error_event
from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams
from kvserve.shared.store.block_data import KVTail
from kvserve.shared.telemetry import (
    KVSERVE_REQUEST_ID,
    current_traceparent,
    get_logger,
    get_tracer,
)
from opentelemetry import trace

wlog = get_logger("kvserve.disagg")
tracer = get_tracer("kvserve.disagg")

Forward = Callable[[GenerateRequest], Awaitable[Any]]


class PrefillWorker(EngineWorker):
    """Prefill side of the handoff (see the module docstring). `forward` puts a prefilled
    request on the decode stream."""

    role = "prefill"

    def __init__(self, port: WorkerPort, engine: AsyncEngine, forward: Forward, **kw: Any):
        super().__init__(port, engine, **kw)
        self.forward = forward

    async def _serve(self, d: Delivery) -> None:
        """The request under its `kvserve.prefill.request` span; acked at the end, unless a
        bus call failed on the way (then it runs again after a pause, as on EngineWorker)."""
        req = d.request
        assert isinstance(req, GenerateRequest)
        done = True
        try:
            with request_span(tracer, "kvserve.prefill.request", req, self.model_name):
                found = await self._prefill(req)
                if found is not None:
                    await self._forward(req, *found)
        except Exception as e:
            if is_bus_error(e):
                done = False
                self._run_again(d, e)
            else:
                wlog.exception("prefill failed", request_id=req.request_id)
                with contextlib.suppress(Exception):
                    await self._fail(req, ErrorInfo("prefill failed", "server_error"))
        finally:
            if done:
                self._failures.pop(d.message_id, None)
                await self._ack(d)

    async def _forward(self, req: GenerateRequest, cached: int, by_tier: dict[str, int]) -> None:
        fwd = dataclasses.replace(
            req,
            traceparent=current_traceparent(),
            submitted_at=time.time(),
            num_cached_tokens=cached,
            cached_tokens_by_source=by_tier,
        )
        await self.forward(fwd)

    async def _prefill(self, req: GenerateRequest) -> tuple[int, dict[str, int]] | None:
        """Compute and store the prompt's KV: the prompt tokens found cached, and by tier, when
        the request goes on to decode; None when it ends here (cancelled, refused or failed)."""
        if not await self._admissible(req, lambda info: self._fail(req, info)):
            return None
        prompt = list(req.prompt_token_ids)
        try:
            self.engine.validate(prompt, req.sampling)
        except InvalidRequestError as e:
            await self._fail(req, ErrorInfo(str(e), "invalid_request_error", e.param))
            return None
        if len(prompt) < 2:
            return 0, {}  # nothing before the last token: decode computes it all
        local = await self._prefix_match(req, prompt[:-1])
        try:
            last = await self._compute(req, prompt[:-1], local)
        except asyncio.CancelledError:
            wlog.info("prefill cancelled", request_id=req.request_id)
            return None
        if last is None:
            last = RequestOutput(req.request_id, prompt[:-1], 0, [], True)
        set_cached_tokens(trace.get_current_span(), last.num_cached_tokens)
        set_cache_sources(trace.get_current_span(), last.cached_tokens_by_source, last.store_lookup)
        await self._publish_tail(req, last.kv_tail)
        return last.num_cached_tokens, last.cached_tokens_by_source

    async def _compute(
        self, req: GenerateRequest, head: list[int], local: int
    ) -> RequestOutput | None:
        """Run the prompt's head (all but its last token) under the `kvserve.compute` span;
        its last output, which carries the tail. `local`: tokens the local tiers held."""
        last: RequestOutput | None = None
        with tracer.start_as_current_span("kvserve.compute") as compute:
            stream = self.engine.generate(
                req.request_id,
                head,
                SamplingParams(max_tokens=1),
                cache_salt=req.cache_salt,
                export_tail=True,
            )
            async with contextlib.aclosing(stream):
                async for out in stream:
                    last = out
            cached = last.num_cached_tokens if last is not None else 0
            set_cached_tokens(compute, cached)
            compute.set_attribute("kvserve.computed_tokens", len(head) - cached)
            compute.set_attribute("kvserve.cached_tokens.store", max(0, cached - local))
        return last

    async def _prefix_match(self, req: GenerateRequest, prompt: list[int]) -> int:
        """The `kvserve.prefix_match` span: how many of the prompt's full blocks the local
        tiers hold (device cache, then host tier), looked up on the engine thread before the
        compute (which then also asks the store for the rest). Returns the local tokens."""
        bs = self.engine.block_size
        with tracer.start_as_current_span(
            "kvserve.prefix_match", attributes={KVSERVE_REQUEST_ID: req.request_id}
        ) as span:
            n, device, host = await self.engine.local_prefix(prompt, req.cache_salt)
            span.set_attribute("kvserve.prefix.full_blocks", n)
            span.set_attribute("kvserve.cached_tokens.device", device * bs)
            span.set_attribute("kvserve.cached_tokens.host", host * bs)
            set_cached_tokens(span, (device + host) * bs)
        return (device + host) * bs

    async def _publish_tail(self, req: GenerateRequest, tail: KVTail | None) -> None:
        """The `kvserve.store_publish` span: the tail under the request's key, then every
        queued block written out."""
        with tracer.start_as_current_span("kvserve.store_publish") as pub:
            pub.set_attribute("kvserve.tail_tokens", len(tail.token_ids) if tail else 0)
            flushed = await asyncio.to_thread(self._publish, req.request_id, tail)
            pub.set_attribute("kvserve.flushed", flushed)

    def _publish(self, request_id: str, tail: KVTail | None) -> bool:
        return self.engine.hand_off(request_id, tail)

    async def _fail(self, req: GenerateRequest, info: ErrorInfo) -> None:
        await self.port.emit(error_event(req.request_id, 0, info))
