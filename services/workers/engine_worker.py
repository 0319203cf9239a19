"""EngineWorker: takes requests off the bus, runs them on an AsyncEngine, puts token events back.

One asyncio task per request. A cancel (client gone, deadline, shutdown) cancels that task; the
AsyncEngine generator's cleanup then aborts the request in the engine, which frees its blocks.

The worker describes itself on the bus (`info()`: role, incarnation, block identity, shared
store); with `kv_events` it also publishes its KV-cache manager's tier changes
(services/workers/kv_events.py), so that a gateway can route by cache contents.

Invariants:
- Every delivery is acked exactly once, after its request finished, failed or was cancelled
  (so a worker that dies mid-request leaves the request pending for another worker); a request
  during which a bus call failed is not acked but run again here after a pause.
- A request's events carry seq 0, 1, 2, ... in order; one event per completion delta that has
  tokens, text or a finish reason; an error event is the last one.
- Exact-token resumption: a request claimed from a dead worker (or run again here) first reads
  the events already emitted for it; each completion goes on from the last token the client
  received (prompt + those tokens prefilled, from the store where present; the sampler's
  per-position seeds make it the same generation), numbering its events after them.
- A request id runs at most once at a time on this worker (a redelivery of a request still
  running here is dropped).
- Fencing: a take-over writes a fence event of its delivery's epoch before it reads what was
  emitted, and every event carries the epoch, so readers drop a stale holder's later events;
  a worker told that its delivery was taken over (`on_taken_over`) stops the request, freeing
  its blocks, and its ack of that delivery does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvserve.services.workers.admin_jobs import run_admin_job
from kvserve.services.workers.kv_events import KVEventPublisher
from kvserve.services.workers.probation import Probation
from kvserve.services.workers.spans import request_span, set_cache_sources, set_cached_tokens
from kvserve.services.workers.token_events import TakenOver, TokenEmitter, taken_over
from kvserve.shared.bus.base import Delivery, WorkerPort, is_bus_error
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.engine.failure import RequestFailedError
from kvserve.shared.engine.outputs import Emitted, RequestOutput
from kvserve.shared.protocol import (
    AdminRequest,
    ErrorInfo,
    GenerateRequest,
    WorkerInfo,
    fence_event,
)
from kvserve.shared.sampling_params import InvalidRequestError
from kvserve.shared.tasks import cancel_all, cancel_and_wait
from kvserve.shared.telemetry import (
    GEN_AI_OUTPUT_TOKENS,
    get_logger,
    get_tracer,
)

log = get_logger("kvserve.worker")
tracer = get_tracer("kvserve.worker")

Fail = Callable[[ErrorInfo], Awaitable[None]]


@dataclass
class _Running:
    delivery: Delivery
    task: asyncio.Task[None]


class EngineWorker:
    model_name: str | None = None  # for the spans' gen_ai.request.model
    role = "worker"

    def __init__(
        self,
        port: WorkerPort,
        engine: AsyncEngine,
        max_receive: int = 64,
        poll_s: float = 1.0,
        kv_events: bool = False,
        quarantine_after: int = 2,
    ) -> None:
        """`quarantine_after`: a taken-over request whose runs killed this many workers is
        failed, not run again (services/workers/probation.py)."""
        self.port = port
        self.engine = engine
        self.max_receive = max_receive
        self.poll_s = poll_s
        self.incarnation = uuid.uuid4().hex
        self.kv_events = (
            KVEventPublisher(port, engine.kv_events, self.incarnation, engine.log_kv_snapshot)
            if kv_events
            else None
        )
        self._running: dict[str, _Running] = {}
        self._accepting = True
        self._loops: list[asyncio.Task[None]] = []
        self._cancelling: set[asyncio.Task[None]] = set()  # cancel_and_wait of cancelled requests
        self._failures: dict[str, int] = {}  # bus failures per delivery, while it runs again
        self.engine_failed = asyncio.Event()  # the engine thread died: the process should end
        self.probation = Probation(port, quarantine_after, self._start, self._quarantine)
        self.quarantined = 0  # taken-over requests failed for the workers they killed

    @property
    def num_running(self) -> int:
        return len(self._running)

    def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        return {
            **stats,
            "worker_requests": len(self._running),
            "bus_dropped": self.port.dropped(),  # bus entries refused unread
            # the engine's quarantines (failed steps) and the bus's (workers that died)
            "num_requests_quarantined": stats["num_requests_quarantined"]
            + self.port.quarantined
            + self.quarantined,
        }

    def info(self) -> WorkerInfo:
        """This worker as a router sees it: its blocks' identity and the store it shares."""
        identity = self.engine.identity
        meta = identity.meta
        store = self.engine.store_url
        return WorkerInfo(
            name=self.port.name,
            role=self.role,
            incarnation=self.incarnation,
            block_size=meta.block_size,
            model_fp=meta.model_fp,
            tokenizer_fp=identity.tokenizer_fingerprint,
            kv_format=meta.kv_format,
            store_id=shared_store_id(store) if store is not None else "",
        )

    async def start(self) -> None:
        self.port.on_taken_over = self._taken_over
        await self.port.start(self.stats, self.info())
        if self.kv_events is not None:
            self.kv_events.start()
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
        await self.probation.stop()
        await cancel_all(self._loops[1:])
        await asyncio.gather(*self._cancelling)  # their requests have ended by now
        if self.kv_events is not None:
            await self.kv_events.stop()
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

    def _taken_over(self, d: Delivery) -> None:
        """Another worker took the delivery over (this one was paused past the claim timeout):
        stop running it here; its events since the take-over are stale, and it is not acked."""
        running = self._running.get(d.request.request_id)
        if running is not None and running.delivery.message_id == d.message_id:
            log.warning("request taken over by another worker", request_id=d.request.request_id)
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
        taken_over = d.redelivered and d.message_id not in self._failures
        if taken_over and isinstance(d.request, GenerateRequest):
            self.probation.submit(d)  # its worker died: run it on probation
        else:
            self._start(d)

    def _start(self, d: Delivery) -> asyncio.Task[None]:
        rid = d.request.request_id
        work = self._admin(d) if isinstance(d.request, AdminRequest) else self._serve(d)
        task = asyncio.create_task(work, name=f"request-{rid}")
        self._running[rid] = _Running(d, task)

        def forget(_task: asyncio.Task[None]) -> None:
            self._running.pop(rid, None)

        task.add_done_callback(forget)
        return task

    async def _quarantine(self, d: Delivery, deaths: int) -> None:
        """Fail a taken-over request whose runs killed `deaths` workers, to its client (an
        error event of this delivery's epoch, after its fence), and ack it."""
        req = d.request
        assert isinstance(req, GenerateRequest)
        log.error("quarantining a request that killed its workers", request_id=req.request_id,
                  deaths=deaths)  # fmt: skip
        self.quarantined += 1
        info = ErrorInfo(
            f"request {req.request_id} quarantined: {deaths} workers died running it; it is "
            "not run again",
            "server_error",
            None,
            "quarantined",
        )
        try:
            await self.port.emit(fence_event(req.request_id, d.epoch))
            out = TokenEmitter(self.port, req.request_id, len(req.prompt_token_ids), None, d.epoch)
            await out.error(info)
        except Exception as e:
            if not is_bus_error(e):
                raise
            log.warning("bus failed quarantining a request; trying again", error=str(e))
            asyncio.get_running_loop().call_later(self.poll_s, self.probation.submit, d)
            return
        await self._ack(d)

    async def _ack(self, d: Delivery) -> None:
        """The delivery is done with (finished, failed or cancelled); a bus error here leaves
        it pending, to be claimed again."""
        with contextlib.suppress(Exception):
            await self.port.ack(d)

    async def _admin(self, d: Delivery) -> None:
        """A warm-up or flush job (services/workers/admin_jobs.py)."""
        assert isinstance(d.request, AdminRequest)
        try:
            await run_admin_job(self.port, self.engine, d.request)
        finally:
            await self._ack(d)

    async def _admissible(self, req: GenerateRequest, fail: Fail) -> bool:
        """Should the request run? Not when it was cancelled before it got here (it ends
        silently) or its deadline has passed (it fails with a timeout)."""
        if await self.port.is_cancelled(req.request_id):
            return False
        if req.deadline is not None and time.time() > req.deadline:
            await fail(ErrorInfo("request deadline passed before it ran", "timeout"))
            return False
        return True

    # ---- one request ----------------------------------------------------------------------

    async def _serve(self, d: Delivery) -> None:
        """The request under its `kvserve.worker.generate` span; acked at the end, unless a
        bus call failed on the way (then its answer may not have reached the gateway: it runs
        again after a pause, and its events, re-emitted from seq 0, are deduplicated)."""
        req = d.request
        assert isinstance(req, GenerateRequest)
        done = True
        try:
            with request_span(tracer, "kvserve.worker.generate", req, self.model_name) as span:
                taken = None
                if d.redelivered:  # fence off the earlier holder before reading its events
                    await self.port.emit(fence_event(req.request_id, d.epoch))
                if d.redelivered or d.message_id in self._failures:
                    taken = taken_over(await self.port.emitted(req.request_id), req.n)
                    span.set_attribute("kvserve.resumed_tokens", taken.output_tokens)
                emitted = await self._run(req, taken, d.epoch)
                span.set_attribute(GEN_AI_OUTPUT_TOKENS, emitted.output_tokens)
                set_cached_tokens(span, emitted.cached_tokens)
                set_cache_sources(span, emitted.cached_tokens_by_source, emitted.store_lookup)
        except Exception as e:  # _run lets only bus errors through
            if not is_bus_error(e):
                raise
            done = False
            self._run_again(d, e)
        finally:
            if done:
                self._failures.pop(d.message_id, None)
                await self._ack(d)

    def _run_again(self, d: Delivery, error: Exception) -> None:
        """Admit `d` again after a pause that doubles with each failure (at most 10 s)."""
        tries = self._failures[d.message_id] = self._failures.get(d.message_id, 0) + 1
        pause = min(10.0, self.poll_s * 2 ** (tries - 1))
        rid = d.request.request_id
        log.warning("bus failed mid-request; running it again", request_id=rid, error=str(error))

        def again() -> None:
            if self._accepting:
                self._admit(d)

        asyncio.get_running_loop().call_later(pause, again)

    async def _run(
        self, req: GenerateRequest, taken: TakenOver | None = None, epoch: int = 1
    ) -> TokenEmitter:
        """Run the request to its end: its outputs, or its error, as events of `epoch`. A
        request taken over (`taken`: what its earlier run emitted) goes on from the client's
        last token."""
        out = TokenEmitter(self.port, req.request_id, len(req.prompt_token_ids), taken, epoch)
        if taken is not None and taken.ended:
            return out
        if not await self._admissible(req, out.error):
            return out
        if taken is not None and taken.output_tokens:
            log.info("taking over a request", request_id=req.request_id, tokens=taken.output_tokens)
        try:
            await self._emit_outputs(req, out, taken)
        except InvalidRequestError as e:
            await out.error(ErrorInfo(str(e), "invalid_request_error", e.param))
        except RequestFailedError as e:  # failed alone, the engine goes on (it logged why)
            log.warning("request failed in the engine", request_id=req.request_id, kind=e.kind)
            await out.error(ErrorInfo(str(e), "server_error", None, e.kind))
        except asyncio.CancelledError:
            # Cancelled by a Cancel message or shutdown: the engine generator's cleanup has
            # aborted the request. Tell a reader that may still listen, then stop quietly.
            with contextlib.suppress(Exception):
                await out.error(ErrorInfo("request cancelled", "cancelled"))
        except Exception as e:
            if is_bus_error(e):
                raise  # the answer may not reach the gateway: _serve runs it again
            log.exception("request failed", request_id=req.request_id)
            await out.error(ErrorInfo(f"internal error: {type(e).__name__}", "server_error"))
            await self._leave_if_engine_failed()
        return out

    async def _emit_outputs(
        self, req: GenerateRequest, out: TokenEmitter, taken: TakenOver | None
    ) -> None:
        """The engine's outputs as token events, under a `kvserve.prefill` span until the
        first output and a `kvserve.decode` span after it."""
        resume = taken.completions if taken is not None and taken.completions else None
        stream = self._generate(req, resume)
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
                        self.probation.first_output(req.request_id)
                    await out.deltas(output)
        finally:
            (prefill if decode is None else decode).end()

    async def _leave_if_engine_failed(self) -> None:
        """The engine thread is dead: leave the bus so /ready says so and no new request is
        sent here, and set `engine_failed` (the process then exits non-zero, for its
        supervisor to start a new one)."""
        if not self.engine.healthy and self._accepting:
            log.error("engine failed; the worker stops taking requests")
            self._accepting = False
            self.engine_failed.set()
            await self.port.close()

    def _generate(
        self, req: GenerateRequest, resume: dict[int, Emitted] | None
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs from the engine (a decode worker adds the handoff's tail);
        `resume`: what the client has of each completion, when the request was taken over."""
        return self.engine.generate(
            req.request_id,
            req.prompt_token_ids,
            req.sampling,
            cache_salt=req.cache_salt,
            resume=resume,
        )


def shared_store_id(url: str | None) -> str:
    """The name under which workers share a store: a Redis (Cluster) URL without credentials
    or options; "" for a store of the process's own (memory, a local disk, none)."""
    from urllib.parse import urlsplit

    from kvserve.shared.config import REMOTE_STORE_SCHEMES

    parts = urlsplit(url or "")
    if parts.scheme.lower() not in REMOTE_STORE_SCHEMES:
        return ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"
