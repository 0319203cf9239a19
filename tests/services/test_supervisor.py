"""The supervisor of `kvserve stack`'s processes: the back-off sequence (exact delays on a fake
clock), a restarted child's unchanged command line and its one log line, the leader's exit
reported without a restart, and real processes: a killed child comes back under a new pid and
`stop` ends them all."""

from __future__ import annotations

import signal
import sys

from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.supervisor import Backoff, Supervisor, describe


class FakeProc:
    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fake_supervisor() -> tuple[Supervisor, Clock, list[FakeProc], list[str]]:
    """A gateway and worker-0 on fake processes and a fake clock, with the default back-off."""
    clock, spawned, lines = Clock(), list[FakeProc](), list[str]()

    def spawn(command: list[str]) -> FakeProc:
        spawned.append(FakeProc(command))
        return spawned[-1]

    sup = Supervisor(
        ("gateway", ["gw"]), [("worker-0", ["w", "--name", "worker-0"])], Backoff(),
        spawn=spawn, clock=clock, log=lines.append,
    )  # fmt: skip
    return sup, clock, spawned, lines


def test_backoff_doubles_to_its_cap_and_resets_after_a_long_run() -> None:
    b = Backoff(first_s=1.0, cap_s=30.0, reset_after_s=60.0)
    delays: list[float] = []
    previous = None
    for _ in range(7):
        previous = b.delay(previous, uptime_s=5.0)
        delays.append(previous)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert b.delay(30.0, uptime_s=59.9) == 30.0
    assert b.delay(30.0, uptime_s=60.0) == 1.0


def test_an_exited_child_restarts_after_its_backoff_with_the_same_command() -> None:
    sup, clock, spawned, lines = fake_supervisor()
    child = sup.children[0]
    assert len(spawned) == 2
    for n, delay in enumerate([1.0, 2.0, 4.0], start=1):
        child.proc.code = -9
        clock.now += 3.0
        assert sup.step() is None
        assert lines[-1] == (
            f"worker-0 exited with code -9 (SIGKILL); restarting it in {delay:g} s (restart {n})"
        )
        clock.now += delay - 0.01
        assert sup.step() is None and len(spawned) == n + 1  # not yet
        clock.now += 0.01
        assert sup.step() is None and len(spawned) == n + 2
        assert spawned[-1].command == ["w", "--name", "worker-0"] and child.proc is spawned[-1]
    assert child.restarts == 3 and len(lines) == 3
    child.proc.code = 1
    clock.now += 60.0  # a healthy run: the doubling starts over
    sup.step()
    assert lines[-1] == "worker-0 exited with code 1; restarting it in 1 s (restart 4)"


def test_the_leader_exiting_is_reported_not_restarted() -> None:
    sup, clock, spawned, lines = fake_supervisor()
    sup.children[0].proc.code = 0
    sup.leader.proc.code = 3
    clock.now += 100.0
    assert sup.step() == 3
    assert lines == ["gateway exited with code 3; stopping the others"]
    assert len(spawned) == 2 and sup.children[0].restart_at is None


def test_describe_names_the_signal() -> None:
    assert [describe(c) for c in (0, 1, -15, -9)] == ["0", "1", "-15 (SIGTERM)", "-9 (SIGKILL)"]


def test_real_processes_restart_under_a_new_pid_and_stop() -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    lines: list[str] = []
    sup = Supervisor(("gateway", sleeper), [("worker-0", sleeper)], Backoff(first_s=0.1),
                     log=lines.append)  # fmt: skip
    try:
        first = sup.children[0].proc
        first.send_signal(signal.SIGKILL)
        first.wait(10)

        def restarted() -> bool:
            assert sup.step() is None
            return sup.children[0].proc is not first and sup.children[0].proc.poll() is None

        poll_until(restarted, timeout=10, interval=0.05)
        assert sup.children[0].proc.pid != first.pid
        assert lines == [
            "worker-0 exited with code -9 (SIGKILL); restarting it in 0.1 s (restart 1)"
        ]
    finally:
        sup.stop(grace=5)
    assert sup.leader.proc.poll() == -signal.SIGTERM
    assert sup.children[0].proc.poll() == -signal.SIGTERM
