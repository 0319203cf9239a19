"""AsyncEngine: the asyncio API the services use — add a request, iterate its outputs as they
are produced, abort it.

One background thread owns the Engine and runs `step()` while there is work (torch releases
the GIL in its kernels, so the event loop stays responsive). Requests and aborts reach that
thread through a queue; outputs come back through per-request asyncio queues (the engine's
`on_outputs` hook, so that steps taken inside an engine call, such as a warm-up, deliver too).
A consumer that stops iterating (cancelled, client gone) aborts its request, freeing its blocks.

It is all the services see of the engine: besides requests it offers what the workers need
(the hand-off and tail fetch of the disaggregated topology, the local prefix, KV events, cache
admin) and the engine's identity and start-up figures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import sys
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.kv.events import TierLog
from kvserve.shared.engine.kv.manager import KVIdentity
from kvserve.shared.engine.outputs import RequestOutput
from kvserve.shared.engine.sim.runner import SimulatedRunner
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.block_data import KVTail

# The longest a thread that wants the GIL waits for one that holds it running Python (the
# interpreter's default is 5 ms).
GIL_SWITCH_INTERVAL_S = 0.0005


def share_the_gil() -> None:
    """Hand the GIL between threads every 0.5 ms at most (unless the process asked for less).
    The engine thread releases the GIL in every C++ kernel and must take it back when the
    kernel returns, while the event loop (the HTTP responses, the store's reads) and the
    emitter run Python: with the default 5 ms it could wait up to a step's length for them.
    Served on a 2-vCPU EPYC (docs/benchmarks.md): batch-1 TPOT 18.2 against 20.9 ms, the means
    of five interleaved pairs, and 12-16% more output tok/s at 16 concurrent requests."""
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    cache_salt: str | None = None
    kv_tail: Any = None  # KVTail (decode side of a prefill/decode handoff)
    export_tail: bool = False  # prefill side: the finished output carries the prompt's tail
    resume: Any = None  # {index: Emitted}: taken over from a worker that died mid-request


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _EngineCall:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | _EngineCall | None] = queue.SimpleQueue()
        self._sinks: dict[str, _Add] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        engine.on_outputs = self._deliver_all

    @classmethod
    def build(cls, make: Callable[[], Engine]) -> AsyncEngine:
        """An AsyncEngine over the Engine `make()` returns, made on the thread that then steps
        it (blocks until it is made; raises what `make` raised). torch's OpenMP keeps a pool of
        worker threads for each thread that computes in parallel: an engine loaded on one
        thread and stepped on another left two pools on the cores, more threads than cores, so
        that their workers slept between parallel regions instead of spinning and a two-thread
        step took as long as a one-thread step (8.6 against 4.7 ms at batch 1 on an AMX
        Xeon)."""
        made: queue.SimpleQueue[AsyncEngine | BaseException] = queue.SimpleQueue()

        def run() -> None:
            try:
                engine = make()
            except BaseException as e:  # handed to the caller
                made.put(e)
                return
            built = cls(engine)
            built._thread = threading.current_thread()
            made.put(built)
            built._run()

        threading.Thread(target=run, name="kvserve-engine", daemon=True).start()
        got = made.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join()
            self._thread = None

    @property
    def num_requests(self) -> int:
        return len(self._sinks)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        *,
        kv_tail: Any = None,
        export_tail: bool = False,
        resume: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield this request's outputs (deltas) until the finished one. Raises
        InvalidRequestError before yielding anything for a request that can never run.
        `kv_tail` / `export_tail`: the disaggregation handoff, `resume`: what the client
        already has of each completion, as in `Engine.add_request`."""
        if self._error is not None:
            raise RuntimeError("the engine thread has failed") from self._error
        self.validate(prompt_token_ids, params)
        self.start()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._inbox.put(
            _Add(
                request_id,
                list(prompt_token_ids),
                params,
                sink,
                loop,
                cache_salt=cache_salt,
                kv_tail=kv_tail,
                export_tail=export_tail,
                resume=resume,
            )
        )
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:  # the engine failed this request alone
                    finished = True
                    raise item.error
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread between two steps and return its result (or raise
        its exception). `fn` may step the engine itself (`Engine.warmup`): the outputs those
        steps produce for other requests still reach their consumers."""
        if self._error is not None:
            raise RuntimeError("the engine thread has failed") from self._error
        self.start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(_EngineCall(fn, future, loop))
        return await future

    @property
    def healthy(self) -> bool:
        """False once the engine thread has died (every later request fails)."""
        return self._error is None

    # ---- what the workers need of the engine ---------------------------------------------

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def identity(self) -> KVIdentity:
        """What makes this engine's blocks interchangeable with another's."""
        return self.engine.kv.identity

    @property
    def store_url(self) -> str | None:
        """The prefix store's URL (None: no store)."""
        kv = self.engine.kv
        return kv.store_config.url if kv.has_store and kv.store_config is not None else None

    def log_steps(self, path: str) -> None:
        """Append every step's shape and model-call seconds to `path` (StepLog), from now on.
        Set before the engine thread starts."""
        from kvserve.shared.engine.sim.step_log import StepLog

        self.engine.on_step = StepLog(path)

    @property
    def simulation(self) -> str | None:
        """What a simulated engine models, in one line (None: a real engine)."""
        sim = self.engine.simulated
        return sim.describe() if sim is not None else None

    @property
    def startup_s(self) -> dict[str, float]:
        return dict(self.engine.startup_s)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError for a request that can never run (any thread)."""
        self.engine.validate(prompt_token_ids, params)

    @property
    def kv_events(self) -> TierLog:
        """The tier changes of the engine's blocks (enable it before reading; any thread)."""
        return self.engine.kv.events

    async def log_kv_snapshot(self) -> None:
        """Log every block the device and host tiers hold, in order with the other changes."""
        await self.call(self.engine.kv.log_snapshot)

    async def local_prefix(
        self, prompt: Sequence[int], cache_salt: str | None
    ) -> tuple[int, int, int]:
        """The prompt's full blocks before its last token, and how many of them the device
        cache holds and the host tier continues with (looked up on the engine thread)."""
        kv = self.engine.kv
        head = list(prompt[:-1])  # the last token is always computed

        def lookup() -> tuple[int, int, int]:
            hashes = kv.prefix_hashes(head, cache_salt)
            return len(hashes), *kv.local_prefix(hashes)

        result: tuple[int, int, int] = await self.call(lookup)
        return result

    def hand_off(self, request_id: str, tail: KVTail | None) -> bool:
        """Prefill's side of a disaggregated request (blocking: run it in a thread)."""
        return self.engine.kv.hand_off(request_id, tail)

    def fetch_tail(
        self, request_id: str, token_ids: list[int]
    ) -> concurrent.futures.Future[KVTail | None] | None:
        """Decode's side: the tail prefill stored for this request (None: no store)."""
        return self.engine.kv.fetch_tail(request_id, token_ids)

    async def warmup(
        self, prefix: Sequence[int], cache_salt: str | None, request_id: str
    ) -> dict[str, int]:
        """One prefix's warm-up job on the engine thread (Engine.warmup)."""
        result: dict[str, int] = await self.call(
            lambda: self.engine.warmup(prefix, cache_salt, request_id)
        )
        return result

    async def reset_prefix_cache(self) -> dict[str, int]:
        """Drop the device cache's unreferenced blocks and the host tier (engine thread)."""
        result: dict[str, int] = await self.call(self.engine.reset_prefix_cache)
        return result

    def close(self) -> None:
        """Stop the engine thread, then write out queued blocks and close the store
        (blocking)."""
        self.stop()
        self.engine.close()

    def stats(self) -> dict[str, Any]:
        """A snapshot of the engine's counters, read from any thread (plain int reads: the
        numbers may be one step apart from each other, never torn). Requests the engine
        holds but does not run (queued, or waiting for a store fetch) count as waiting."""
        eng = self.engine
        sched = eng.scheduler
        running = len({s.request_id for s in list(sched.running)})
        prefix = eng.prefix_cache_stats
        kv = eng.kv.stats()
        return {
            "num_requests_running": running,
            "num_requests_waiting": max(0, eng.num_requests - running),
            "num_blocks": kv["num_blocks"],
            "num_used_blocks": kv["num_used_blocks"],
            "kv_cache_usage_perc": kv["kv_cache_usage_perc"],
            "block_size": eng.block_size,
            "max_model_len": eng.max_model_len,
            "prefix_cache_queries": prefix["queries_tokens"],
            "prefix_cache_hits": prefix["hits_tokens"],
            "cached_blocks": prefix["cached_blocks"],
            "evicted_blocks": prefix["evicted_blocks"],
            "cached_tokens_by_source": {
                k.removeprefix("hits_tokens_"): v
                for k, v in prefix.items()
                if k.startswith("hits_tokens_")
            },
            "num_preemptions": sched.num_preemptions,
            **{f"spec_decode_{k}": v for k, v in eng.spec_decode_stats.items()},
            "num_steps": eng.num_steps,
            "num_step_failures": eng.num_step_failures,
            "num_requests_failed": eng.num_failed_requests,
            "num_requests_quarantined": eng.num_quarantined,
            "healthy": self.healthy,
            "store": self._store_stats(),
            "kv_tier_events": kv["tier_events"],
            "store_latency": eng.kv.store_latency(),
            "store_load_cost": eng.kv.store_load_cost(),
            **self._simulation_stats(),
        }

    def _simulation_stats(self) -> dict[str, Any]:
        """A simulated engine's modelled seconds and the wall seconds its steps ran past their
        modelled end (its host work outgrew the time scale); nothing for a real one."""
        runner = self.engine.runner
        if self.engine.simulated is None or not isinstance(runner, SimulatedRunner):
            return {}
        return {"simulation": {"modelled_s": runner.modelled_s, "late_s": runner.late_s}}

    def _store_stats(self) -> dict[str, Any]:
        """The store connector's counters; its dicts are written by other threads, so a copy
        that races a write is retried once, then skipped."""
        for _ in range(2):
            try:
                return dict(self.engine.store_stats())
            except RuntimeError:  # dictionary changed size during iteration
                continue
        return {}

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        share_the_gil()
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain(block):
                    return
                self.engine.step()  # its outputs reach their consumers through on_outputs
        except BaseException as e:  # surface to every waiting request, then stop
            self._error = e
            for add in list(self._sinks.values()):
                add.loop.call_soon_threadsafe(add.sink.put_nowait, e)
            self._sinks.clear()

    def _drain(self, block: bool) -> bool:
        """Apply queued adds/aborts; wait for one if `block`. False when asked to stop."""
        while True:
            try:
                cmd = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is None:
                return False
            if isinstance(cmd, _Abort):
                self.engine.abort_request(cmd.request_id)
                self._sinks.pop(cmd.request_id, None)
                continue
            if isinstance(cmd, _EngineCall):
                self._call(cmd)
                continue
            try:
                self.engine.add_request(
                    cmd.request_id,
                    cmd.prompt,
                    cmd.params,
                    cmd.cache_salt,
                    kv_tail=cmd.kv_tail,
                    export_tail=cmd.export_tail,
                    resume=cmd.resume,
                )
            except Exception as e:
                cmd.loop.call_soon_threadsafe(cmd.sink.put_nowait, e)
                continue
            self._sinks[cmd.request_id] = cmd

    def _call(self, cmd: _EngineCall) -> None:
        try:
            result = cmd.fn()
        except Exception as e:
            self._settle(cmd, None, e)
        else:
            self._settle(cmd, result, None)

    @staticmethod
    def _settle(cmd: _EngineCall, result: Any, error: BaseException | None) -> None:
        def settle() -> None:
            if cmd.future.done():
                return
            if error is not None:
                cmd.future.set_exception(error)
            else:
                cmd.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the caller's loop is closed
            cmd.loop.call_soon_threadsafe(settle)

    def _deliver_all(self, outs: list[RequestOutput]) -> None:
        """A step's outputs to their consumers: one callback per event loop (one wake-up of
        that loop per step, however many of its requests the step advanced)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Add, RequestOutput]]] = {}
        for out in outs:
            add = self._sinks.get(out.request_id)
            if add is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            by_loop.setdefault(add.loop, []).append((add, out))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the consumer's loop is closed
                loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[_Add, RequestOutput]]) -> None:
    for add, out in items:
        add.sink.put_nowait(out)
