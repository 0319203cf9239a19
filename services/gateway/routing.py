"""RoutingService: the gateway's router (services/gateway/router.py) fed from the bus.

Two tasks keep the router current: one refreshes the live workers and their stats every
`refresh_s` (a worker whose heartbeat stopped drops out within the bus's worker TTL, a restarted
one comes back with a new incarnation and an empty index), one reads the workers' KV events
and asks a worker whose events had a gap for a snapshot of its blocks. Both log a bus failure
and try again, so routing resumes by itself when Redis returns.

`route` picks a worker for a prompt under a `kvserve.route` span: an aggregated worker when any
is live, else a prefill worker (the disaggregated topology), else None (the request goes to the
shared stream, which every such worker also reads). `finished` gives the decision back with the
cached tokens the worker reported, which measures the router's prediction error.

Metrics: `kvserve:router_decisions_total{reason}`, `kvserve:router_decision_seconds`,
`kvserve:router_prediction_error_tokens` (|predicted - actual| per request),
`kvserve:router_{predicted,actual}_cached_tokens_total`, `kvserve:router_kv_events_total{outcome}`
and, per worker, `kvserve:router_indexed_blocks` / `kvserve:router_in_flight_requests`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import Any

from kvserve.services.gateway.router import Decision, Router
from kvserve.shared.bus.base import Bus
from kvserve.shared.tasks import cancel_all
from kvserve.shared.telemetry import PREFIX, TOKEN_BUCKETS, get_logger, get_tracer
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = get_logger("kvserve.gateway")
tracer = get_tracer("kvserve.gateway")

DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)
ROLES = ("worker", "prefill")  # who takes a new request, in order of preference


class RoutingService:
    def __init__(
        self,
        bus: Bus,
        router: Router,
        registry: CollectorRegistry,
        refresh_s: float = 1.0,
        pd_threshold: int = 0,
    ) -> None:
        self.bus = bus
        self.router = router
        # Disaggregated topology: a request whose uncached part (as predicted) is shorter than
        # this many tokens skips the prefill worker; a decode worker computes it (0: never).
        self.pd_threshold = pd_threshold
        self.refresh_s = refresh_s
        self.metrics = _RouterMetrics(registry, router)
        self.totals: Counter[str] = Counter()  # requests, predicted, actual, abs_error tokens
        self._seconds: deque[float] = deque(maxlen=1000)  # the latest decision times
        # How far behind the workers' KV events the router reads: the latest and the largest.
        self.kv_event_lag_s: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._loop(self._refresh_once, self.refresh_s), name="router"),
            asyncio.create_task(self._loop(self._read_events, 0.0), name="router-kv-events"),
        ]

    async def stop(self) -> None:
        await cancel_all(self._tasks)

    async def _loop(self, step: Any, pause_s: float) -> None:
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis down: try again after a pause
                log.warning("router: bus read failed", error=str(e), step=step.__name__)
                pause_s = max(pause_s, 1.0)
            await asyncio.sleep(pause_s)

    async def _refresh_once(self) -> None:
        infos = await self.bus.workers()
        stats = await self.bus.stats() if infos else {}
        self.router.set_workers(infos, stats)

    async def _read_events(self) -> None:
        outcomes = self.router.apply(await self.bus.kv_events(block_ms=1000))
        age = self.bus.kv_event_age_s()
        if age is not None:
            lag = self.kv_event_lag_s
            lag["last"], lag["max"] = age, max(age, lag.get("max", 0.0))
        for outcome, n in outcomes.items():
            self.metrics.events.labels(outcome).inc(n)
        for worker in self.router.take_lost_track():
            await self.bus.request_resync(worker)

    def route(
        self, prompt: Sequence[int], cache_salt: str | None, user: str | None = None
    ) -> Decision | None:
        """`user`: the request's session key (the OpenAI `user`), for the "session" policy;
        kept off the span, as it may name a person."""
        with tracer.start_as_current_span("kvserve.route") as span:
            t0 = time.perf_counter()
            decision = None
            for role in ROLES:
                decision = self.router.route(prompt, cache_salt, role, user)
                if decision is not None:
                    break
            if decision is not None and decision.role == "prefill":
                decision = self._short_prefill(decision, prompt, cache_salt, user)
            seconds = time.perf_counter() - t0
            span.set_attribute("kvserve.route.policy", self.router.policy)
            if decision is None:
                span.set_attribute("kvserve.route.reason", "no-worker-known")
                return None
            span.set_attribute("kvserve.route.worker", decision.worker)
            span.set_attribute("kvserve.route.reason", decision.reason)
            span.set_attribute(
                "kvserve.route.predicted_cached_tokens", decision.predicted_cached_tokens
            )
        self.metrics.decisions.labels(decision.reason).inc()
        self.metrics.seconds.observe(seconds)
        self._seconds.append(seconds)
        return decision

    def _short_prefill(
        self, decision: Decision, prompt: Sequence[int], cache_salt: str | None, user: str | None
    ) -> Decision:
        """A prefill worker's decision, or, when the part of the prompt it would compute is
        shorter than `pd_threshold`, a decode worker's (which computes it itself: a hand-off
        through the store would cost more than that prefill saves the decode worker)."""
        uncached = len(prompt) - decision.predicted_cached_tokens
        if uncached >= self.pd_threshold:
            return decision
        direct = self.router.route(prompt, cache_salt, "decode", user, reason="short-prefill")
        if direct is None:
            return decision
        self.router.withdraw(decision)
        return direct

    def targets(self) -> list[str]:
        """Every live worker that takes new requests (a flush goes to each)."""
        return self.router.workers()

    def finished(self, decision: Decision, cached_tokens: int | None) -> None:
        """The request ended; `cached_tokens` as its worker reported them (None: unknown)."""
        self.router.finished(decision, computed=cached_tokens is not None)
        if cached_tokens is None:
            return
        error = abs(decision.predicted_cached_tokens - cached_tokens)
        self.totals.update(
            requests=1,
            predicted_cached_tokens=decision.predicted_cached_tokens,
            actual_cached_tokens=cached_tokens,
            abs_error_tokens=error,
        )
        self.metrics.predicted.inc(decision.predicted_cached_tokens)
        self.metrics.actual.inc(cached_tokens)
        self.metrics.error.observe(error)

    def stats(self) -> dict[str, Any]:
        """For /v1/cache/stats: the router's own stats, the prediction totals and the recent
        decision times (microseconds)."""
        seconds = sorted(self._seconds)
        us = {
            "mean": 1e6 * sum(seconds) / len(seconds) if seconds else None,
            "p50": 1e6 * seconds[len(seconds) // 2] if seconds else None,
            "p99": 1e6 * seconds[int(len(seconds) * 0.99)] if seconds else None,
        }
        lag = dict(self.kv_event_lag_s)
        return {**self.router.stats(), **self.totals, "decision_us": us, "kv_event_lag_s": lag}


class _RouterMetrics(Collector):
    """The router's Prometheus metrics; per-worker gauges read from the router at scrape."""

    def __init__(self, registry: CollectorRegistry, router: Router) -> None:
        self.router = router

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> PromCounter:
            return PromCounter(PREFIX + name, doc, labels, registry=registry)

        self.decisions = counter("router_decisions", "Routing decisions by reason.", ["reason"])
        self.events = counter("router_kv_events", "KV events read, by outcome.", ["outcome"])
        self.predicted = counter("router_predicted_cached_tokens", "Cached tokens predicted.")
        self.actual = counter("router_actual_cached_tokens", "Cached tokens workers reported.")
        self.seconds = Histogram(
            PREFIX + "router_decision_seconds", "Time to route one request.",
            registry=registry, buckets=DECISION_BUCKETS,
        )  # fmt: skip
        self.error = Histogram(
            PREFIX + "router_prediction_error_tokens",
            "|predicted - actual| cached prompt tokens per routed request.",
            registry=registry, buckets=(0, *TOKEN_BUCKETS),
        )  # fmt: skip
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        workers = self.router.stats().get("workers", {})
        for key, name, doc in (
            ("indexed_blocks", "router_indexed_blocks", "Blocks the router knows a worker holds."),
            ("in_flight", "router_in_flight_requests", "Requests routed to a worker, unfinished."),
        ):
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=["worker"])
            for worker, s in workers.items():
                fam.add_metric([worker], float(s.get(key, 0)))
            yield fam
