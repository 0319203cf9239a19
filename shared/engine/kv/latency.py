"""LatencyStats: the store calls' latencies ("get", "put") as fixed-bucket histograms, plus
error counts, for the `kvserve:store_*` Prometheus metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Upper bounds (seconds) of the store-call latency histograms (Prometheus `le` buckets).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class _OpLatency:
    counts: list[int]  # per bucket, the last one +Inf
    sum: float = 0.0
    count: int = 0
    errors: int = 0


class LatencyStats:
    """Per-operation call latencies ("get", "put") as fixed-bucket histograms, plus error
    counts; written from the store thread, read (`snapshot`) from any thread under a lock."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(buckets)
        self._lock = threading.Lock()
        self._ops: dict[str, _OpLatency] = {}

    def _op(self, op: str) -> _OpLatency:
        entry = self._ops.get(op)
        if entry is None:
            entry = self._ops[op] = _OpLatency([0] * (len(self.bounds) + 1))
        return entry

    def observe(self, op: str, seconds: float) -> None:
        i = next((k for k, b in enumerate(self.bounds) if seconds <= b), len(self.bounds))
        with self._lock:
            e = self._op(op)
            e.counts[i] += 1
            e.sum += seconds
            e.count += 1

    def error(self, op: str) -> None:
        with self._lock:
            self._op(op).errors += 1

    def snapshot(self) -> dict[str, Any]:
        """{"bounds": [...], op: {"counts" (per bucket, the last one +Inf), "sum", "count",
        "errors"}} (plain lists and numbers: it travels in the workers' msgpack stats)."""
        with self._lock:
            out: dict[str, Any] = {"bounds": list(self.bounds)}
            for op, e in self._ops.items():
                out[op] = {"counts": list(e.counts), "sum": e.sum, "count": e.count,
                           "errors": e.errors}  # fmt: skip
            return out

    class _Timer:
        def __init__(self, stats: LatencyStats, op: str) -> None:
            self.stats, self.op = stats, op

        def __enter__(self) -> None:
            self.t0 = time.perf_counter()

        def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
            if exc_type is None:
                self.stats.observe(self.op, time.perf_counter() - self.t0)
            elif exc_type is not asyncio.CancelledError:
                self.stats.error(self.op)

    def time(self, op: str) -> LatencyStats._Timer:
        """`with stats.time("get"): ...`: one observation, or one error if it raises
        (a timeout included; a cancellation counts as neither)."""
        return LatencyStats._Timer(self, op)
