"""A worker's Prometheus endpoint: its engine's statistics under vLLM's metric names
(kvserve.shared.telemetry.EngineStatsCollector), served over HTTP on a port of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvserve.shared.telemetry import EngineStatsCollector
from prometheus_client import CollectorRegistry, start_http_server


class WorkerStatsCollector(EngineStatsCollector):
    """Reads the worker's stats at each scrape (the gateway's collector reads them from the
    bus instead)."""

    def __init__(self, model_name: str, worker: str, stats: Callable[[], Any]) -> None:
        super().__init__(model_name)
        self.worker = worker
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        self.snapshot = {self.worker: self.stats()}
        yield from super().collect()


def serve_worker_metrics(
    host: str, port: int, model_name: str, worker: str, stats: Callable[[], Any]
) -> str:
    """Serve `stats()` as Prometheus metrics on host:port (a daemon thread); the URL to scrape.
    OSError when the port cannot be bound."""
    registry = CollectorRegistry()
    registry.register(WorkerStatsCollector(model_name, worker, stats))
    start_http_server(port, host, registry=registry)
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{url_host}:{port}/metrics"
