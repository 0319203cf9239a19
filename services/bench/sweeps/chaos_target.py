"""The topologies `kvserve bench chaos` loads and breaks, one process each (so that one can be
killed) on the proxied Redis: `serve`, `fleet` (a gateway and 2 workers) or `disagg` (a gateway,
2 prefill and 2 decode workers). Stores use the native format, so that a greedy answer is the
same whichever tier served its prefix."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.fleet import Fleet
from kvserve.services.bench.lib.http import gateway_stats
from kvserve.services.bench.lib.process import HttpReady, ServerProcess, StartError, free_port
from kvserve.services.cli_support import CliError

TARGETS = ("serve", "fleet", "disagg")
ROLES = {"fleet": ["worker"] * 2, "disagg": ["prefill"] * 2 + ["decode"] * 2}
WORKER_FLAGS = ("--store-format", "native", "--threads", "1", "--metrics-port", "0",
                "--claim-idle", "3", "--drain-timeout", "5")  # fmt: skip


class Target:
    """A kvserve topology on the proxied Redis at `redis_url`; its logs in `out`. The front
    process (`serve`, or `gateway`) is ready once /ready answers and, for a gateway, it lists
    every worker; the workers log only warnings, so they are spawned, never waited for alone."""

    def __init__(self, kind: str, redis_url: str, args: argparse.Namespace, out: Path) -> None:
        self.kind = kind
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.fleet = Fleet(args.model, out)
        engine = ["--num-blocks", "512", "--log-level", "warning"]
        http = ["--port", str(self.port), "--max-queue", str(args.max_queue)]
        roles = ROLES.get(kind, [])
        self.workers = len(roles)
        ready = HttpReady("/ready", self.workers)
        if kind == "serve":
            self.front = "serve"
            self.fleet.process("serve", ["serve"], *http, *engine, "--store", redis_url,
                               "--store-format", "native", "--threads", "2",
                               ready=ready, url=self.base_url)  # fmt: skip
            return
        self.front = "gateway"
        self.fleet.process("gateway", ["gateway"], *http, "--bus", redis_url,
                           "--log-level", "warning", ready=ready, url=self.base_url)  # fmt: skip
        for i, role in enumerate(roles):
            name = f"{role}-{i % 2}"
            self.fleet.process(name, [role], "--bus", redis_url, "--store", redis_url, *engine,
                               "--name", name, *WORKER_FLAGS)  # fmt: skip

    @property
    def procs(self) -> dict[str, ServerProcess]:
        return self.fleet.procs

    def start(self) -> None:
        for p in self.fleet:
            p.spawn()
        self.wait_ready()

    def wait_ready(self, timeout: float = 300.0) -> None:
        try:
            self.procs[self.front].wait_ready(timeout)
        except StartError as e:
            why = str(e).splitlines()[0]
            raise CliError(
                f"{self.kind}: not ready after {timeout:.0f} s ({why}; logs: --out)"
            ) from None

    def stats(self) -> dict[str, Any]:
        return gateway_stats(self.base_url)

    def rss_mb(self) -> float:
        return self.fleet.rss_mb()

    def stop(self) -> None:
        self.fleet.stop(grace=30)


async def idle(target: Target, timeout: float = 120.0) -> dict[str, Any]:
    """The server's stats once nothing runs or waits there (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await asyncio.to_thread(target.stats)
        t = stats.get("totals") or {}
        if stats and not t.get("num_requests_running") and not t.get("num_requests_waiting"):
            return stats
        if time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.5)
