"""BusGeneration: one HTTP generation request on the bus, as the gateway's handler drives it.

It owns a bus request per prompt of the plan (ids `{request_id}-{p}` when there are several),
merges their token events in arrival order, holds the request's deadline, observes time to
first token and inter-token latency, and at the end cancels whatever has not finished. With a
`routing` service each bus request goes to the worker the router picks (the plan's `user` is
its session key; the decision is given back, with the cached tokens the worker reported, at
`close`). A sampled request without a seed gets one here, so that a worker that takes it over
from a dead one (it runs it again from the start; the events the client has already had are
dropped by seq) draws the same tokens and the client's stream stays one generation. It imports
no torch (the gateway never does)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvserve.services.gateway.errors import APIError
from kvserve.services.gateway.schema import GenerationPlan
from kvserve.shared.bus.base import Bus, BusFullError, EventStream
from kvserve.shared.protocol import GenerateRequest, TokenEvent
from kvserve.shared.tasks import cancel_all
from kvserve.shared.telemetry import current_traceparent, get_logger

log = get_logger("kvserve.gateway")


@dataclass
class BusGeneration:
    """`metrics`: the gateway's Metrics (its ttft and itl histograms, labelled `model_name`).
    Lifecycle: `submit()`, then `events()` until the end, then `close()` (always)."""

    bus: Bus
    plan: GenerationPlan
    request_id: str
    salt: str | None
    timeout_s: float
    metrics: Any
    model_name: str
    t0: float = field(default_factory=time.monotonic)
    deadline: float = 0.0  # on the event loop's clock
    streams: list[EventStream] = field(default_factory=list)
    first_token_at: float | None = None
    error_type: str | None = None  # of the error event that ended the request, if one did
    _last_token: float | None = None
    routing: Any = None  # a RoutingService, or None: the shared stream, any worker
    decisions: list[Any] = field(default_factory=list)  # per prompt: the router's, or None
    cached_tokens: dict[int, int] = field(default_factory=dict)  # per prompt, as reported
    cancel_reason: str = "client"  # what `close` tells the workers ("stalled": stopped reading)

    def _sub_id(self, p: int) -> str:
        return self.request_id if len(self.plan.prompts) == 1 else f"{self.request_id}-{p}"

    async def submit(self) -> None:
        """Put a request per prompt on the bus; the deadline starts now."""
        self.deadline = asyncio.get_running_loop().time() + self.timeout_s
        deadline = time.time() + self.timeout_s
        traceparent = current_traceparent()
        params = self.plan.params
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=random.randrange(1 << 62))
        for p, prompt in enumerate(self.plan.prompts):
            req = GenerateRequest(
                request_id=self._sub_id(p),
                prompt_token_ids=prompt,
                sampling=params,
                cache_salt=self.salt,
                traceparent=traceparent,
                deadline=deadline,
            )
            decision = (
                self.routing.route(prompt, self.salt, self.plan.user) if self.routing else None
            )
            self.decisions.append(decision)
            worker = decision.worker if decision is not None else None
            try:
                self.streams.append(await self.bus.submit(req, worker))
            except BusFullError as e:
                raise APIError(
                    503, "The event bus is full; retry shortly.", "server_error", None,
                    "bus_full", headers={"Retry-After": "1"},
                ) from e  # fmt: skip

    @property
    def all_done(self) -> bool:
        return all(s.done for s in self.streams)

    def timeout_error(self) -> APIError:
        return APIError(
            504, f"request exceeded the timeout of {self.timeout_s:g} s", "timeout", None, "timeout"
        )

    async def events(self) -> AsyncGenerator[tuple[int, TokenEvent], None]:
        """(prompt index, event) until every stream ended (the caller bounds the wait by
        `deadline`: a timeout scope must not span a generator's yields)."""
        async for item in self._merged():
            p, ev = item
            if ev.error is not None:
                self.error_type = ev.error.type
            else:
                self.cached_tokens[p] = max(self.cached_tokens.get(p, 0), ev.num_cached_tokens)
            self._observe(ev)
            yield item

    async def _merged(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        if len(self.streams) == 1:
            async for ev in self.streams[0]:
                yield 0, ev
            return
        queue: asyncio.Queue[tuple[int, TokenEvent] | None] = asyncio.Queue()

        async def pump(p: int, stream: EventStream) -> None:
            try:
                async for ev in stream:
                    await queue.put((p, ev))
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(self.streams)]
        try:
            live = len(tasks)
            while live:
                item = await queue.get()
                if item is None:
                    live -= 1
                    continue
                yield item
                if item[1].error is not None:
                    return
        finally:
            await cancel_all(tasks)

    def _observe(self, event: TokenEvent) -> None:
        if not event.token_ids:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now - self.t0
            self.metrics.ttft.labels(self.model_name).observe(self.first_token_at)
        elif self._last_token is not None:
            gap = (now - self._last_token) / len(event.token_ids)
            for _ in event.token_ids:
                self.metrics.itl.labels(self.model_name).observe(gap)
        self._last_token = now

    async def close(self) -> None:
        """Cancel every sub-request that has not ended; release the event streams. Shielded:
        this runs while the handler is being cancelled (client gone)."""
        pending = [(p, s) for p, s in enumerate(self.streams) if not s.done]
        for p, decision in enumerate(self.decisions):
            if decision is not None:
                self.routing.finished(decision, self.cached_tokens.get(p))
        work = self._cancel_and_close(pending)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(work)

    async def _cancel_and_close(self, pending: list[tuple[int, EventStream]]) -> None:
        for p, _ in pending:
            with contextlib.suppress(Exception):
                await self.bus.cancel(self._sub_id(p), self.cancel_reason)
        if pending:
            log.info("cancelled", sub_requests=len(pending), reason=self.cancel_reason)
        for s in self.streams:
            with contextlib.suppress(Exception):
                await s.close()
