"""The supervisor of a chaos target's processes, as compose's `restart: unless-stopped` is in a
deployment: a process found ended is recorded as a death and spawned again `respawn_s` later
(a request that kills its worker needs the fleet restarted around it).

Invariants: the processes a fault ends on purpose are `held` while it holds them: neither
counted nor restarted (the fault restarts them itself). Each death is recorded once, by pid.
Only `run` mutates `deaths` and spawns, on its event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from kvserve.services.bench.lib.process import ServerProcess


@dataclass(frozen=True)
class Death:
    name: str
    at: float  # time.monotonic()
    returncode: int | None


class Supervisor:
    """Watches `procs` (name -> process, read at each poll) every `poll_s` seconds."""

    def __init__(
        self, procs: Mapping[str, ServerProcess], respawn_s: float = 1.0, poll_s: float = 0.2
    ) -> None:
        self.procs = procs
        self.respawn_s = respawn_s
        self.poll_s = poll_s
        self.held: set[str] = set()
        self.deaths: list[Death] = []
        self._seen: set[int] = set()  # pids whose death is recorded
        self._respawns: set[asyncio.Task[None]] = set()

    @contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """While inside, `name` is the caller's to end and restart."""
        self.held.add(name)
        try:
            yield
        finally:
            self.held.discard(name)

    def since(self, t: float) -> list[Death]:
        return [d for d in self.deaths if d.at >= t]

    async def run(self) -> None:
        try:
            while True:
                self.check()
                await asyncio.sleep(self.poll_s)
        finally:
            for task in list(self._respawns):
                task.cancel()

    def check(self) -> None:
        """Record every process found ended since the last check; schedule its restart."""
        for name, p in self.procs.items():
            if name in self.held or p.proc is None or p.running or p.proc.pid in self._seen:
                continue
            self._seen.add(p.proc.pid)
            self.deaths.append(Death(name, time.monotonic(), p.proc.returncode))
            task = asyncio.create_task(self._respawn(name))
            self._respawns.add(task)
            task.add_done_callback(self._respawns.discard)

    async def settle(self) -> None:
        """Return once every restart scheduled so far has been made."""
        await asyncio.gather(*list(self._respawns), return_exceptions=True)

    async def _respawn(self, name: str) -> None:
        await asyncio.sleep(self.respawn_s)
        p = self.procs[name]
        if name not in self.held and not p.running:
            p.spawn()
