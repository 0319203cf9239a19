"""The generation routes, POST /v1/completions and /v1/chat/completions: parse the body into a
plan, admit it, send it over the bus, and answer with one JSON body or an SSE stream.

Invariants:
- A request that leaves the handler before all its events arrived (client gone, deadline,
  error) is cancelled on the bus (`BusGeneration.close`), so the worker aborts it and frees its
  blocks.
- An error before the first token is an HTTP error with the OpenAI shape; after the stream has
  started it is an SSE error event followed by `data: [DONE]`.
- A stream's writes wait at most `GatewayConfig.stream_stall_timeout_s` for a client that stopped
  reading (sse_writer.py); past it the connection is aborted and the request cancelled on the bus
  (reason `stalled`), counted in `kvserve:stream_stalls_total` and logged, once."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import structlog
from aiohttp import web
from kvserve.services.gateway.context import GatewayContext
from kvserve.services.gateway.errors import APIError, from_worker, sse_error
from kvserve.services.gateway.generation import BusGeneration
from kvserve.services.gateway.middleware import TENANT_SALT
from kvserve.services.gateway.request_telemetry import record_finish, request_attributes
from kvserve.services.gateway.responses import SSE_DONE, ResponseBuilder, sse
from kvserve.services.gateway.schema import (
    GenerationPlan,
    parse_chat,
    parse_completion,
    with_fault,
)
from kvserve.services.gateway.sse_writer import SSEWriter, StreamStalledError
from kvserve.shared.protocol import TokenEvent
from kvserve.shared.telemetry import context_from_traceparent, get_logger, get_tracer
from opentelemetry.trace import SpanKind, Status, StatusCode

log = get_logger("kvserve.gateway")
tracer = get_tracer("kvserve.gateway")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
STALLED = "stalled"  # the status and cancel reason of a request whose client stopped reading


class CompletionRoutes:
    """Holds no request state: each request's lives in its BusGeneration and ResponseBuilder;
    the context's admission counts it while it runs."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.ctx.json_body(request)
        plan = parse_completion(body, self.ctx.model)
        return await self._generate(request, with_fault(plan, body, self._faults))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.ctx.json_body(request)
        plan = parse_chat(body, self.ctx.model)
        return await self._generate(request, with_fault(plan, body, self._faults))

    @property
    def _faults(self) -> bool:
        return self.ctx.config.fault_injection

    async def _generate(self, request: web.Request, plan: GenerationPlan) -> web.StreamResponse:
        ctx = self.ctx
        salt = ctx.keys.effective_salt(request.get(TENANT_SALT), plan.cache_salt)
        await ctx.readiness.require_worker()
        with ctx.admission.admit():
            return await self._handle_generation(request, plan, salt)

    async def _handle_generation(
        self, request: web.Request, plan: GenerationPlan, salt: str | None
    ) -> web.StreamResponse:
        """The whole life of an admitted generation request: its server span and log context,
        the bus requests, the response (JSON or SSE), then cancels, metrics and the span's
        usage attributes, whatever way it ends."""
        ctx = self.ctx
        op = "chat" if plan.kind == "chat" else "text_completion"
        rid = ("chatcmpl-" if plan.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        with (
            tracer.start_as_current_span(
                f"{op} {plan.model}",
                context=context_from_traceparent(request.headers.get("traceparent")),
                kind=SpanKind.SERVER,
                attributes=request_attributes(op, plan, rid),
            ) as span,
            structlog.contextvars.bound_contextvars(request_id=rid),
        ):
            call = BusGeneration(
                ctx.bus, plan, rid, salt, ctx.config.request_timeout_s, ctx.metrics,
                ctx.model.name, routing=ctx.routing,
            )  # fmt: skip
            builder = ResponseBuilder(plan, rid, ctx.model.tokenizer, plan.model)
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
                if call.cancel_reason == STALLED:
                    status = STALLED
                await call.close()
                record_finish(span, ctx.metrics, call, builder, status)

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
            out = SSEWriter(resp, request.transport, self.ctx.config.stream_stall_timeout_s)
            try:
                for chunk in builder.opening_chunks():
                    await out.write(sse(chunk))
                await out.write(sse(builder.event_chunk(*first)))
                await self._stream_rest(out, call, builder, events)
                await out.write(SSE_DONE)
                await out.write_eof()
            except ConnectionResetError:
                log.info("client went away mid-stream")
            except StreamStalledError as e:
                self._stalled(call, e)
        return resp

    def _stalled(self, call: BusGeneration, error: StreamStalledError) -> None:
        """Count and log a stalled stream; its request is then cancelled as stalled. No await
        here: the aborted connection's handler may be cancelled at its next one."""
        call.cancel_reason = STALLED
        self.ctx.metrics.stream_stalls.labels(call.model_name).inc()
        log.warning("stream stalled, request aborted", reason=str(error))

    async def _stream_rest(
        self,
        out: SSEWriter,
        call: BusGeneration,
        builder: ResponseBuilder,
        events: AsyncIterator[tuple[int, TokenEvent]],
    ) -> None:
        try:
            async with asyncio.timeout_at(call.deadline):
                async for p, event in events:
                    if event.error is not None:
                        await out.write(sse_error(from_worker(event.error)))
                        return
                    await out.write(sse(builder.event_chunk(p, event)))
        except TimeoutError:
            await out.write(sse_error(call.timeout_error()))
            return
        if builder.plan.include_usage:
            await out.write(sse(builder.usage_chunk()))
