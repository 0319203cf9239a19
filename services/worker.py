"""EngineWorker: takes requests off the bus, runs them on an AsyncEngine, puts token events back.

One asyncio task per request. A cancel (client gone, deadline, shutdown) cancels that task; the
AsyncEngine generator's cleanup then aborts the request in the engine, which frees its blocks.

Invariants:
- Every delivery is acked exactly once, after its request finished, failed or was cancelled
  (so a worker that dies mid-request leaves the request pending for another worker).
- A request's events carry seq 0, 1, 2, ... in order; one event per completion delta that has
  tokens, text or a finish reason; an error event is the last one.
- A request id runs at most once at a time on this worker (a redelivery of a request still
  running here is dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from kvserve.shared.bus import Delivery, WorkerPort, error_event
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.engine.engine import RequestOutput
from kvserve.shared.protocol import AdminRequest, ErrorInfo, GenerateRequest, TokenEvent
from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams
from kvserve.shared.tasks import cancel_all, cancel_and_wait
from kvserve.shared.telemetry import (
    GEN_AI_CACHED_TOKENS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_REQUEST_MODEL,
    KVSERVE_CACHED_TOKENS,
    KVSERVE_REQUEST_ID,
    context_from_traceparent,
    get_logger,
    get_tracer,
)

log = get_logger("kvserve.worker")
tracer = get_tracer("kvserve.worker")

_TUPLE_FIELDS = ("stop", "stop_token_ids")


def sampling_params_from_dict(d: dict[str, Any]) -> SamplingParams:
    """The bus carries SamplingParams as a plain dict; lists become the tuples it holds."""
    known = set(SamplingParams.__dataclass_fields__)
    unknown = set(d) - known
    if unknown:
        raise InvalidRequestError(sorted(unknown)[0], f"unknown sampling parameter {unknown}")
    kw: dict[str, Any] = {
        k: tuple(v) if k in _TUPLE_FIELDS and v is not None else v for k, v in d.items()
    }
    try:
        return SamplingParams(**kw)
    except TypeError as e:
        raise InvalidRequestError("sampling", str(e)) from e


@dataclass
class _Running:
    delivery: Delivery
    task: asyncio.Task[None]


class EngineWorker:
    model_name: str | None = None  # for the spans' gen_ai.request.model

    def __init__(
        self,
        port: WorkerPort,
        engine: AsyncEngine,
        max_receive: int = 64,
        poll_s: float = 1.0,
    ) -> None:
        self.port = port
        self.engine = engine
        self.max_receive = max_receive
        self.poll_s = poll_s
        self._running: dict[str, _Running] = {}
        self._accepting = True
        self._loops: list[asyncio.Task[None]] = []
        self._cancelling: set[asyncio.Task[None]] = set()  # cancel_and_wait of cancelled requests

    @property
    def num_running(self) -> int:
        return len(self._running)

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "worker_requests": len(self._running)}

    async def start(self) -> None:
        await self.port.start(self.stats)
        self._loops = [
            asyncio.create_task(self._receive_loop(), name="worker-receive"),
            asyncio.create_task(self._cancel_loop(), name="worker-cancels"),
        ]
        log.info("worker started", worker=self.port.name)

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Stop taking requests, let running ones finish (at most `drain_timeout` seconds),
        cancel the rest, deregister."""
        self._accepting = False
        if self._loops:
            await cancel_and_wait(self._loops[0])  # receive
        tasks = [r.task for r in self._running.values()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout)
            await cancel_all(pending)
        await cancel_all(self._loops[1:])
        await asyncio.gather(*self._cancelling)  # their requests have ended by now
        await self.port.close()
        log.info("worker stopped", worker=self.port.name)

    # ---- loops ----------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while self._accepting:
            try:
                deliveries = await self.port.receive(self.max_receive, self.poll_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("bus receive failed")
                await asyncio.sleep(self.poll_s)  # back off before retrying the bus
                continue
            for d in deliveries:
                self._admit(d)

    async def _cancel_loop(self) -> None:
        while True:
            try:
                cancels = await self.port.cancels(self.poll_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("bus cancel read failed")
                await asyncio.sleep(self.poll_s)
                continue
            for c in cancels:
                running = self._running.get(c.request_id)
                if running is not None:
                    log.info("cancelling request", request_id=c.request_id, reason=c.reason)
                    self._cancel(running.task)

    def _cancel(self, task: asyncio.Task[None]) -> None:
        """Cancel a request's task without waiting for it (the cancel loop reads on)."""
        stopping = asyncio.create_task(cancel_and_wait(task))
        self._cancelling.add(stopping)
        stopping.add_done_callback(self._cancelling.discard)

    def _admit(self, d: Delivery) -> None:
        rid = d.request.request_id
        if rid in self._running:
            log.warning("dropping a redelivery of a running request", request_id=rid)
            return
        work = self._admin(d) if isinstance(d.request, AdminRequest) else self._serve(d)
        task = asyncio.create_task(work, name=f"request-{rid}")
        self._running[rid] = _Running(d, task)

        def forget(_task: asyncio.Task[None]) -> None:
            self._running.pop(rid, None)

        task.add_done_callback(forget)

    # ---- admin jobs -----------------------------------------------------------------------

    async def _admin(self, d: Delivery) -> None:
        """A warm-up or flush job: one event per prefix (warm-up) with the running counters in
        `info`, the last with finish_reason "stop"; an error event if the job fails."""
        job = d.request
        assert isinstance(job, AdminRequest)
        seq = 0

        async def emit(info: dict[str, Any], finish: str | None = None) -> None:
            nonlocal seq
            await self.port.emit(
                TokenEvent(request_id=job.request_id, seq=seq, info=info, finish_reason=finish)
            )
            seq += 1

        try:
            with tracer.start_as_current_span(
                f"kvserve.cache.{job.op}",
                context=context_from_traceparent(job.traceparent),
                attributes={KVSERVE_REQUEST_ID: job.request_id},
            ):
                eng = self.engine.engine
                if job.op == "flush":
                    got = await self.engine.call(eng.reset_prefix_cache)
                    await emit({**got, "worker": self.port.name}, "stop")
                    log.info("prefix cache flushed", **got)
                else:
                    total = len(job.prefixes)
                    counts = {"done": 0, "total": total, "blocks": 0, "computed": 0,
                              "skipped": 0, "published": 0}  # fmt: skip
                    for i, p in enumerate(job.prefixes):

                        def one(p: dict[str, Any] = p, i: int = i) -> dict[str, int]:
                            rid = f"{job.request_id}-{i}"
                            return eng.warmup(p["token_ids"], p.get("cache_salt"), rid)

                        got = await self.engine.call(one)
                        for k in ("blocks", "computed", "skipped", "published"):
                            counts[k] += int(got[k])
                        counts["done"] = i + 1
                        await emit(dict(counts), "stop" if i + 1 == total else None)
                    if not total:
                        await emit(counts, "stop")
        except InvalidRequestError as e:
            await self._admin_error(job, seq, ErrorInfo(str(e), "invalid_request_error", e.param))
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self._admin_error(job, seq, ErrorInfo("job cancelled", "cancelled"))
        except Exception as e:
            log.exception("admin job failed", request_id=job.request_id, op=job.op)
            await self._admin_error(job, seq, ErrorInfo(f"{job.op} failed: {e}", "server_error"))
        finally:
            with contextlib.suppress(Exception):
                await self.port.ack(d)

    async def _admin_error(self, job: AdminRequest, seq: int, info: ErrorInfo) -> None:
        with contextlib.suppress(Exception):
            await self.port.emit(error_event(job.request_id, seq, info))

    # ---- one request ----------------------------------------------------------------------

    async def _serve(self, d: Delivery) -> None:
        req = d.request
        assert isinstance(req, GenerateRequest)
        ctx = context_from_traceparent(req.traceparent)
        received = time.time()
        try:
            with tracer.start_as_current_span(
                "kvserve.worker.generate",
                context=ctx,
                attributes={KVSERVE_REQUEST_ID: req.request_id, GEN_AI_OPERATION: "generate"},
            ) as span:
                if self.model_name:
                    span.set_attribute(GEN_AI_REQUEST_MODEL, self.model_name)
                queue_span = tracer.start_span(
                    "kvserve.queue", start_time=int(req.submitted_at * 1e9)
                )
                queue_span.end(end_time=int(received * 1e9))
                emitted = await self._run(d)
                span.set_attribute(GEN_AI_INPUT_TOKENS, len(req.prompt_token_ids))
                span.set_attribute(GEN_AI_OUTPUT_TOKENS, emitted.output_tokens)
                span.set_attribute(GEN_AI_CACHED_TOKENS, emitted.cached_tokens)
                span.set_attribute(KVSERVE_CACHED_TOKENS, emitted.cached_tokens)
        finally:
            with contextlib.suppress(Exception):
                await self.port.ack(d)

    async def _run(self, d: Delivery) -> _Emitted:
        req = d.request
        assert isinstance(req, GenerateRequest)
        out = _Emitted(self.port, req.request_id, len(req.prompt_token_ids))
        if await self.port.is_cancelled(req.request_id):
            return out
        if req.deadline is not None and time.time() > req.deadline:
            await out.error(ErrorInfo("request deadline passed before it ran", "timeout"))
            return out
        try:
            params = sampling_params_from_dict(req.sampling)
            stream = self._generate(req, params)
            prefill = tracer.start_span("kvserve.prefill")
            decode = None
            try:
                # aclosing: a cancel lands here and must abort the request in the engine now
                # (the generator's cleanup), not whenever the generator is collected.
                async with contextlib.aclosing(stream):
                    async for output in stream:
                        if decode is None:
                            prefill.end()
                            decode = tracer.start_span("kvserve.decode")
                        await out.deltas(output)
            finally:
                if decode is None:
                    prefill.end()
                else:
                    decode.end()
        except InvalidRequestError as e:
            await out.error(ErrorInfo(str(e), "invalid_request_error", e.param))
        except asyncio.CancelledError:
            # Cancelled by a Cancel message or shutdown: the engine generator's cleanup has
            # aborted the request. Tell a reader that may still listen, then stop quietly.
            with contextlib.suppress(Exception):
                await out.error(ErrorInfo("request cancelled", "cancelled"))
        except Exception as e:
            log.exception("request failed", request_id=req.request_id)
            await out.error(ErrorInfo(f"internal error: {type(e).__name__}", "server_error"))
            if not self.engine.healthy and self._accepting:
                # The engine thread is dead: leave the bus so /ready says so and no new
                # request is sent here.
                log.error("engine failed; the worker stops taking requests")
                self._accepting = False
                await self.port.close()
        return out

    def _generate(
        self, req: GenerateRequest, params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs from the engine (a decode worker adds the handoff's tail)."""
        return self.engine.generate(
            req.request_id, req.prompt_token_ids, params, cache_salt=req.cache_salt
        )


class _Emitted:
    """Turns RequestOutputs into numbered token events on the bus."""

    def __init__(self, port: WorkerPort, request_id: str, num_prompt_tokens: int) -> None:
        self.port = port
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.seq = 0
        self.output_tokens = 0
        self.cached_tokens = 0

    async def deltas(self, output: RequestOutput) -> None:
        self.cached_tokens = output.num_cached_tokens
        for c in output.completions:
            if not (c.token_ids or c.text or c.finish_reason):
                continue
            self.output_tokens += len(c.token_ids)
            await self.port.emit(
                TokenEvent(
                    request_id=self.request_id,
                    seq=self.seq,
                    index=c.index,
                    token_ids=list(c.token_ids),
                    text=c.text,
                    logprobs=[float(x) for x in c.logprobs],
                    top_logprobs=[
                        [[int(t), float(v)] for t, v in top.items()] for top in c.top_logprobs
                    ],
                    finish_reason=c.finish_reason,
                    num_prompt_tokens=self.num_prompt_tokens,
                    num_cached_tokens=output.num_cached_tokens,
                )
            )
            self.seq += 1

    async def error(self, info: ErrorInfo) -> None:
        await self.port.emit(error_event(self.request_id, self.seq, info))
        self.seq += 1
