"""Server processes for benchmarks and tests: `ServerProcess` starts one (any `kvserve`
subcommand: serve, gateway, worker, prefill, decode, stack; llama-server; the HF shim), waits
until it is ready under a deadline, and stops it with everything it started.

Readiness is observed, never assumed:
- `LogReady`: the process's `ready` log event (kvserve's serve, gateway, worker, prefill and
  decode log one, carrying the bound URL): no sleeping, no port guessing.
- `HttpReady(path, workers)`: GET base_url + path answers 200 and, for a kvserve gateway, it
  lists `workers` live workers (llama-server, the HF shim, `kvserve stack`, a kvserve process
  logging below info).

Invariants:
- A process runs in a session of its own; `signal`, `stop` and `kill` reach its whole process
  group (the children of `kvserve stack` too).
- A thread reads its stderr from spawn to exit: every line is kept (`lines()`, `events()`) and,
  given `log`, appended to that file, where its stdout goes too (else stdout is discarded).
- `start` is `spawn` then `wait_ready`; a process that exits first or misses the deadline is
  stopped, and StartError says why with the tail of its output.
- `spawn` after the process ended runs the same command again (a restart; the log appends).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvserve.services.bench.lib.readiness import server_ready

READY_TIMEOUT_S = 180.0
STOP_GRACE_S = 30.0


class StartError(RuntimeError):
    """A process could not be started or did not become ready; the message says why."""


@dataclass(frozen=True)
class LogReady:
    """Ready at the first log line that is a JSON object with this `event` and a `url`."""

    event: str = "ready"


@dataclass(frozen=True)
class HttpReady:
    """Ready once base_url + path answers 200 (and a gateway lists `workers` live workers)."""

    path: str = "/ready"
    workers: int = 0
    interval_s: float = 0.5


Readiness = LogReady | HttpReady


def free_port(exclude: Sequence[int] = ()) -> int:
    """A loopback TCP port nobody listens on now (and not in `exclude`)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in exclude:
            return port


def kvserve_command() -> list[str]:
    """This installation's `kvserve`: the script beside the interpreter, as a user runs it, else
    the interpreter on the command's module."""
    beside = Path(sys.executable).parent / "kvserve"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("kvserve")
    # -P: the working directory stays off sys.path (see stack.commands).
    return [found] if found else [sys.executable, "-P", "-m", "kvserve.services.cli"]


def run_bench_serve(
    url: str, argv: Sequence[str], transcript: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`kvserve bench serve --base-url url *argv`, finished, its output also written to
    `transcript` (RuntimeError with the output's last lines when it fails or prints nothing)."""
    cmd = [*kvserve_command(), "bench", "serve", "--base-url", url, *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if transcript is not None:
        transcript.write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not done.stdout.strip():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-10:])
        raise RuntimeError(f"bench serve exited with {done.returncode}:\n{tail}")
    return done


def parse_event(line: str) -> dict[str, Any] | None:
    """The JSON object a structured log line holds, else None."""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


class ServerProcess:
    """One server subprocess; see the module docstring for its invariants. `url` is the root
    the server answers on: given (HttpReady) or read from its ready event (LogReady)."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        ready: Readiness | None = None,
        url: str = "",
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.ready = ready if ready is not None else LogReady()
        self.url = url
        self.log = log
        self.env = dict(env or {})
        self.proc: subprocess.Popen[str] | None = None
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None

    # ---- life --------------------------------------------------------------------------------

    def spawn(self) -> ServerProcess:
        """Start the process (again, if it ran before) without waiting for it."""
        if self.running:
            raise RuntimeError(f"{self.name}: already running")
        self._ready.clear()
        if isinstance(self.ready, LogReady):
            self.url = ""
        stdout = self._stdout()
        try:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=stdout,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                encoding="utf-8",
                errors="replace",
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        finally:
            if not isinstance(stdout, int):
                stdout.close()  # the child holds its own copy
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()
        return self

    def _stdout(self) -> IO[bytes] | int:
        if self.log is None:
            return subprocess.DEVNULL
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(f"$ {' '.join(self.cmd)}\n".encode())
        return self.log.open("ab")

    def start(self, timeout: float = READY_TIMEOUT_S) -> ServerProcess:
        """spawn, then wait_ready; on any failure the process is stopped."""
        self.spawn()
        try:
            return self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServerProcess:
        """Return once the process is ready; StartError (the process killed) otherwise."""
        try:
            if isinstance(self.ready, LogReady):
                self._wait_event(timeout)
            else:
                self._wait_http(self.ready, timeout)
        except StartError:
            self.kill()
            raise
        return self

    def _wait_event(self, timeout: float) -> None:
        if not self._ready.wait(timeout) or not self.url:
            raise StartError(f"{self.name} did not become ready:\n{self.tail(30)}")

    def _wait_http(self, ready: HttpReady, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = self.url + ready.path
        while not server_ready(self.url, url, ready.workers):
            if not self.running:
                rc = self.proc.returncode if self.proc else None
                raise StartError(
                    f"{self.name}: the server exited with {rc} before it was ready; "
                    f"log {self.log}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise StartError(
                    f"{self.name}: not ready at {url} after {timeout:.0f} s; log {self.log}:\n"
                    + self.tail()
                )
            time.sleep(ready.interval_s)

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        log = self.log.open("a") if self.log is not None else None
        try:
            for line in proc.stderr:
                self._keep(line, log)
        finally:
            if log is not None:
                log.close()
            self._ready.set()  # the process ended: wake the waiter

    def _keep(self, line: str, log: IO[str] | None) -> None:
        with self._lock:
            self._lines.append(line)
        if log is not None:
            log.write(line)
            log.flush()
        if isinstance(self.ready, LogReady) and not self._ready.is_set():
            event = parse_event(line)
            if event is not None and event.get("event") == self.ready.event and "url" in event:
                self.url = str(event["url"])
                self._ready.set()

    # ---- signals and stopping ----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the process group (nothing when the process has ended)."""
        if self.proc is not None and self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """The exit status, once the process has ended within `timeout` (else TimeoutExpired)."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL to the group (a crash); returns once the process is gone."""
        self.signal(signal.SIGKILL)
        self.reap(10.0)

    def reap(self, grace: float) -> None:
        """Wait up to `grace` seconds for the process to end, then SIGKILL the group."""
        if self.proc is not None:
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(5)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to the group, SIGKILL after `grace` seconds; a stopped process stays so."""
        self.terminate()
        self.reap(grace)

    def __enter__(self) -> ServerProcess:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- what it said and what it holds ------------------------------------------------------

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def events(self) -> list[dict[str, Any]]:
        """The JSON objects among its stderr lines, in order."""
        return [e for e in map(parse_event, self.lines()) if e is not None]

    def tail(self, lines: int = 20) -> str:
        """Its last output lines: from its log (stdout too) if it has one, else stderr's."""
        if self.log is not None and self.log.exists():
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return "".join(self.lines()[-lines:])

    def rss_mb(self) -> float:
        """Resident memory of the process itself (0 when it is not running)."""
        if self.proc is None or not self.running:
            return 0.0
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def open_fds(self) -> int:
        """File descriptors the process holds open (0 when it is not running)."""
        if self.proc is None or not self.running:
            return 0
        try:
            return len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        except OSError:
            return 0


def kvserve_process(
    command: Sequence[str],
    args: Sequence[str] = (),
    *,
    name: str = "",
    ready: Readiness | None = None,
    url: str = "",
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """`kvserve COMMAND ARGS`, not spawned (`command`: the subcommand and its leading flags)."""
    cmd = [*kvserve_command(), *command, *args]
    return ServerProcess(name or command[0], cmd, ready=ready, url=url, log=log, env=env)
