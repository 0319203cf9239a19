"""Supervisor: keeps `kvserve stack`'s processes running, as compose's `restart: unless-stopped`
keeps a service's.

A `Child` is one process under its name: the same command line every start, so a restarted
worker keeps its bus name and metrics port. When one exits, `Supervisor.step` logs one line
(its name, exit code and the back-off) and starts it again once the `Backoff` delay has passed:
1 s, doubling with each restart in a row up to 30 s; a run that lasted `reset_after_s` starts
the doubling over. The leader (the gateway) is not restarted: `step` reports its exit and the
caller stops everything. Only `step` starts processes; only `stop` signals them."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Spawn = Callable[[list[str]], Any]  # a command line -> its process (subprocess.Popen's shape)


@dataclass(frozen=True)
class Backoff:
    """The delay before restarting a process that exited after `uptime_s` seconds."""

    first_s: float = 1.0
    cap_s: float = 30.0
    reset_after_s: float = 60.0  # a run this long counts as healthy: the next delay is first_s

    def delay(self, previous_s: float | None, uptime_s: float) -> float:
        """`previous_s`: the delay before the run that just ended (None: it was the first)."""
        if previous_s is None or uptime_s >= self.reset_after_s:
            return self.first_s
        return min(self.cap_s, previous_s * 2)


class Child:
    """One supervised process. `proc` is its latest start; `restart_at` is set (a monotonic
    time) from the moment its exit is seen until it is started again; `delay_s` is the back-off
    its latest restart waited (None until it first restarts)."""

    def __init__(self, name: str, command: list[str], spawn: Spawn, now: float) -> None:
        self.name = name
        self.command = command
        self._spawn = spawn
        self.proc = spawn(command)
        self.started_at = now
        self.delay_s: float | None = None
        self.restart_at: float | None = None
        self.restarts = 0

    def exited(self) -> int | None:
        """The exit code of its latest run once it has ended (negative: killed by a signal)."""
        code: int | None = self.proc.poll()
        return code

    def restart(self, now: float) -> None:
        self.proc = self._spawn(self.command)
        self.started_at = now
        self.restart_at = None
        self.restarts += 1


class Supervisor:
    """The leader and the children it restarts (in start order), on one clock."""

    def __init__(
        self,
        leader: tuple[str, list[str]],
        children: list[tuple[str, list[str]]],
        backoff: Backoff = Backoff(),
        spawn: Spawn = subprocess.Popen,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = print,
    ) -> None:
        self.backoff = backoff
        self._clock = clock
        self._log = log
        self.leader = Child(*leader, spawn, clock())
        self.children = [Child(name, cmd, spawn, clock()) for name, cmd in children]

    def step(self) -> int | None:
        """Restart every child whose back-off has passed, schedule those that exited; the
        leader's exit code once it has exited (nothing restarted then), else None."""
        code = self.leader.exited()
        if code is not None:
            self._log(f"{self.leader.name} exited with code {describe(code)}; stopping the others")
            return code
        now = self._clock()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restart(now)
                continue
            code = child.exited()
            if code is not None:
                self._schedule(child, code, now)
        return None

    def _schedule(self, child: Child, code: int, now: float) -> None:
        child.delay_s = self.backoff.delay(child.delay_s, now - child.started_at)
        child.restart_at = now + child.delay_s
        self._log(
            f"{child.name} exited with code {describe(code)}; restarting it in "
            f"{child.delay_s:g} s (restart {child.restarts + 1})"
        )

    def stop(self, grace: float) -> None:
        """SIGTERM to every process still running, SIGKILL to those still running `grace`
        seconds later; none is restarted after."""
        procs = [c.proc for c in (self.leader, *self.children)]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def describe(code: int) -> str:
    """An exit code as a line says it: `1`, or `-9 (SIGKILL)` for a process a signal ended."""
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)
