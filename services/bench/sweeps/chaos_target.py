"""The topologies `kvserve bench chaos` loads and breaks, one process each (so that one can be
killed) on the proxied Redis servers: `serve` (its store on the store Redis; its bus is in the
process), `fleet` (a gateway and 2 workers) or `disagg` (a gateway, 2 prefill and 2 decode
workers), whose bus is the bus Redis and whose store the store Redis, as in compose.yaml.
Stores use the native format, so that a greedy answer is the same whichever tier served its
prefix. Every process accepts poisoned requests (`--enable-fault-injection`), and the front
aborts a stream whose client stopped reading after STALL_S (`--stream-stall-timeout`)."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.fleet import Fleet
from kvserve.services.bench.lib.http import gateway_stats
from kvserve.services.bench.lib.process import HttpReady, ServerProcess, StartError, free_port
from kvserve.services.bench.lib.readiness import server_ready
from kvserve.services.cli_support import CliError

STALL_S = 5.0  # the front's --stream-stall-timeout in every chaos target
TARGETS = ("serve", "fleet", "disagg")
ROLES = {"fleet": ["worker"] * 2, "disagg": ["prefill"] * 2 + ["decode"] * 2}
CLAIM_IDLE_S = 3.0  # the workers' --claim-idle
WORKER_FLAGS = ("--store-format", "native", "--threads", "1", "--metrics-port", "0",
                "--claim-idle", str(CLAIM_IDLE_S), "--drain-timeout", "5")  # fmt: skip


class Target:
    """A kvserve topology on the bus at `bus_url` (None for `serve`) and the store at
    `store_url`; its logs in `out`. The front process (`serve`, or `gateway`) is ready once
    /ready answers and, for a gateway, it lists every worker; the workers log only warnings, so
    they are spawned, never waited for alone."""

    def __init__(
        self,
        kind: str,
        urls: tuple[str | None, str],
        args: argparse.Namespace,
        out: Path,
    ) -> None:
        bus_url, store_url = urls
        self.kind = kind
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.fleet = Fleet(args.model, out)
        faults = ["--enable-fault-injection"]
        engine = ["--num-blocks", str(args.num_blocks), "--host-tier-mb", str(args.host_tier_mb),
                  "--log-level", "warning", *faults]  # fmt: skip
        http = ["--port", str(self.port), "--max-queue", str(args.max_queue),
                "--stream-stall-timeout", str(STALL_S)]  # fmt: skip
        roles = ROLES.get(kind, [])
        self.workers = len(roles)
        ready = HttpReady("/ready", self.workers)
        if kind == "serve":
            self.front = "serve"
            self.fleet.process("serve", ["serve"], *http, *engine, "--store", store_url,
                               "--store-format", "native", "--threads", "2",
                               ready=ready, url=self.base_url)  # fmt: skip
            return
        self.front = "gateway"
        assert bus_url is not None, f"{kind} needs a bus"
        self.fleet.process("gateway", ["gateway"], *http, "--bus", bus_url, *faults,
                           "--log-level", "warning", ready=ready, url=self.base_url)  # fmt: skip
        for i, role in enumerate(roles):
            name = f"{role}-{i % 2}"
            self.fleet.process(name, [role], "--bus", bus_url, "--store", store_url, *engine,
                               "--name", name, *WORKER_FLAGS)  # fmt: skip

    @property
    def procs(self) -> dict[str, ServerProcess]:
        return self.fleet.procs

    def start(self, timeout: float = 300.0) -> None:
        """Spawn every process and wait until the front is ready; CliError as soon as one of
        them exits (with the end of its log), or after `timeout`."""
        for p in self.fleet:
            p.spawn()
        deadline = time.monotonic() + timeout
        while not server_ready(self.base_url, self.base_url + "/ready", self.workers):
            if dead := [p for p in self.fleet if not p.running]:
                raise CliError(
                    f"{self.kind}: {dead[0].name} exited while starting (log {dead[0].log}):\n"
                    + dead[0].tail(5)
                )
            if time.monotonic() > deadline:
                raise CliError(f"{self.kind}: not ready after {timeout:.0f} s (logs: --out)")
            time.sleep(0.5)

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
