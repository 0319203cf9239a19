"""One deployment of `kvserve bench fleet`: a redis-server of its own (the bus and the shared
prefix store), the real `kvserve gateway` with one arm's routing, and N engine workers: real
`kvserve worker` processes, or simulated ones in one `kvserve sim-fleet` process. Started
fresh for every measured run (empty caches, an empty store) and stopped after it.

While a run goes on, `Observer` samples the gateway's view of the workers once a second (queue
depth); around it, `Counters` reads Redis's command and byte counters and the gateway's CPU
time, so that a run's rates come from differences."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from kvserve.services.bench.lib.fleet import Fleet
from kvserve.services.bench.lib.http import gateway_stats
from kvserve.services.bench.lib.process import StartError, free_port
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.bench.lib.redis_server import RedisServer
from kvserve.services.gateway.router import DEFAULT_STORE_COST

REDIS_MAXMEMORY = "8gb"  # a bound, not a reservation; allkeys-lru as compose.yaml's
READY_S = 600.0


@dataclass(frozen=True)
class Routing:
    """The gateway's routing for an arm."""

    policy: str
    overlap_weight: float = 1.0
    store_cost: float | None = DEFAULT_STORE_COST  # None: auto (each worker's reported ratio)
    pd_threshold: int = 0  # disaggregated: shorter predicted uncached parts go to decode

    def flags(self) -> list[str]:
        cost = "auto" if self.store_cost is None else str(self.store_cost)
        out = ["--routing", self.policy, "--overlap-weight", str(self.overlap_weight),
               "--router-store-cost", cost]  # fmt: skip
        return out + (["--pd-threshold", str(self.pd_threshold)] if self.pd_threshold else [])


@dataclass(frozen=True)
class Workers:
    """N workers: real ones with `threads` torch threads each, or simulated on `profile` at
    `time_scale`; aggregated, or (`prefill` and `decode` > 0) that many of each role."""

    count: int
    profile: str | None = None
    time_scale: float = 1.0
    threads: int = 1
    store_format: str = "auto"
    prefill: int = 0
    decode: int = 0

    @property
    def simulated(self) -> bool:
        return self.profile is not None

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0 and self.decode > 0

    def roles(self) -> list[tuple[str, str]]:
        """(role, name) of every worker, named as sim-fleet names them."""
        if not self.disaggregated:
            return [("worker", f"worker-{i}") for i in range(self.count)]
        return [("prefill", f"worker-prefill-{i}") for i in range(self.prefill)] + [
            ("decode", f"worker-decode-{i}") for i in range(self.decode)
        ]


class Deployment:
    """Redis, gateway and workers of one run (see the module docstring)."""

    def __init__(self, model: Path, routing: Routing, workers: Workers, log_dir: Path) -> None:
        self.routing = routing
        self.workers = workers
        self.log_dir = log_dir
        self.redis = RedisServer(maxmemory=REDIS_MAXMEMORY, log=log_dir / "redis.log")
        self.fleet = Fleet(model, log_dir)
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Deployment:
        """Everything up and the router knowing every worker; StartError (all stopped)."""
        try:
            self.redis.start()
            self._spawn()
            self.fleet.wait_ready(READY_S)
            names = set(self.worker_names())
            poll_until(lambda: set(self.router().get("workers", {})) == names, timeout=60)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        try:
            self.fleet.stop()
        finally:
            self.redis.stop()

    def worker_names(self) -> list[str]:
        return [name for _, name in self.workers.roles()]

    def router(self) -> dict[str, Any]:
        router = gateway_stats(self.url).get("router")
        return router if isinstance(router, dict) else {}

    def _spawn(self) -> None:
        url, w = self.redis.url, self.workers
        self.fleet.process(
            "gateway", ("gateway", "--port", str(self.port)), "--bus", url,
            *self.routing.flags(), "--max-queue", "100000", "--request-timeout", "36000",
        ).spawn()  # fmt: skip
        common = ["--bus", url, "--store", url, "--store-format", w.store_format]
        if w.simulated:
            assert w.profile is not None
            counts = (
                ["--prefill", str(w.prefill), "--decode", str(w.decode)]
                if w.disaggregated
                else ["--workers", str(w.count)]
            )
            self.fleet.process(
                "sim-fleet", ("sim-fleet",), *common, "--profile", w.profile,
                "--time-scale", str(w.time_scale), *counts, "--name-prefix", "worker",
            ).spawn()  # fmt: skip
            return
        env = {"OMP_NUM_THREADS": str(w.threads), "MKL_NUM_THREADS": str(w.threads)}
        for role, name in w.roles():
            self.fleet.process(
                name, (role,), *common, "--name", name, "--threads", str(w.threads),
                "--metrics-port", "0", "--step-log", str(self.step_log(name)),
                "--kv-populate", "eager", env=env,
            ).spawn()  # fmt: skip

    def step_log(self, name: str) -> Path:
        """Where a real worker logs its steps (kvserve worker --step-log)."""
        return self.log_dir / f"steps-{name}.jsonl"

    def pid(self, name: str) -> int:
        proc = self.fleet.procs[name].proc
        if proc is None:
            raise StartError(f"{name} is not running")
        return proc.pid


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Counters:
    """Redis's commands and network bytes, and the gateway's CPU seconds, at one moment."""

    wall_s: float
    commands: int
    net_in: int
    net_out: int
    gateway_cpu_s: float
    used_memory: int

    @classmethod
    def read(cls, deployment: Deployment) -> Counters:
        client = redis.Redis.from_url(deployment.redis.url)
        try:
            info: Any = client.info()
        finally:
            client.close()
        return cls(
            time.monotonic(),
            int(info["total_commands_processed"]),
            int(info["total_net_input_bytes"]),
            int(info["total_net_output_bytes"]),
            cpu_seconds(deployment.pid("gateway")),
            int(info["used_memory"]),
        )

    def rates(self, later: Counters, requests: int, slowdown: float) -> dict[str, float]:
        """Per modelled second (wall / slowdown) and per request, from `self` to `later`."""
        wall = max(1e-9, later.wall_s - self.wall_s)
        modelled = wall / slowdown
        cpu = later.gateway_cpu_s - self.gateway_cpu_s
        return {
            "redis_commands_per_s": (later.commands - self.commands) / modelled,
            "redis_bytes_in_per_s": (later.net_in - self.net_in) / modelled,
            "redis_bytes_out_per_s": (later.net_out - self.net_out) / modelled,
            "redis_used_memory_mb": later.used_memory / 1e6,
            "gateway_cpu_s_per_request": cpu / requests if requests else 0.0,
            "gateway_cpu_frac": cpu / wall,
        }


@dataclass
class Observer:
    """Samples the workers' waiting and running requests (the gateway's totals) every
    `interval_s` of wall time in a thread, until `stop`."""

    url: str
    interval_s: float = 1.0
    waiting: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Observer:
        self._thread = threading.Thread(target=self._loop, name="fleet-observer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        n = len(self.waiting)
        return {
            "queue_depth_mean": sum(self.waiting) / n if n else 0.0,
            "queue_depth_max": float(max(self.waiting, default=0)),
            "running_mean": sum(self.running) / n if n else 0.0,
        }

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            totals = gateway_stats(self.url).get("totals") or {}
            self.waiting.append(int(totals.get("num_requests_waiting") or 0))
            self.running.append(int(totals.get("num_requests_running") or 0))
