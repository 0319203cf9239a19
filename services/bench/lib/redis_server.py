"""Throwaway redis-servers for benchmarks and tests: `RedisServer` on a free loopback port with
no persistence and a working directory of its own; readiness is PING polled under a deadline,
never slept for. `answers` / `redis_answers` say whether a server (such as a shared one on
6379) is there at all."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import redis
import redis.asyncio as aioredis
from kvserve.services.bench.lib.process import StartError, free_port

READY_TIMEOUT_S = 10.0
POLL_S = 0.02


def redis_binaries_present() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def answers(url: str) -> bool:
    """Whether the Redis at `url` (redis:// or rediss://) answers PING within half a second."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


async def redis_answers(url: str) -> bool:
    """`answers`, from a coroutine."""
    client = aioredis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(await client.ping())
    except Exception:
        return False
    finally:
        await client.aclose()


class RedisServer:
    """A redis-server subprocess on a fixed port: no persistence, its own working directory
    (made by `start` and removed by `stop` unless given). With `maxmemory` it is a bounded cache as
    compose.yaml's store: at that size it evicts the least recently used keys (allkeys-lru).

    `kill` is SIGKILL (a crash); `restart` starts it again on the same port and directory, so a
    cluster node comes back with its `nodes.conf` (and, without persistence, no data). Its log
    is `log` (default: redis.log in its directory), its own output included."""

    def __init__(
        self,
        port: int | None = None,
        workdir: Path | None = None,
        extra_args: Sequence[str] = (),
        maxmemory: str | None = None,
        log: Path | None = None,
    ) -> None:
        self.port = port if port is not None else free_port()
        self._own_dir = workdir is None
        # Made by `start`: a server never started leaves nothing behind.
        self.workdir = workdir or Path(tempfile.gettempdir()) / f"kvserve-redis-{uuid.uuid4().hex}"
        self.extra_args = list(extra_args)
        self.maxmemory = maxmemory
        self.log = log or self.workdir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        exe = shutil.which("redis-server")
        if exe is None:
            raise StartError("redis-server is not on PATH")
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir)]
        if self.maxmemory is not None:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        return [exe, *args, "--logfile", str(self.log), *self.extra_args]

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Start the server and return once it answers PING; StartError otherwise."""
        assert not self.running, "already running"
        cmd = self.command()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:  # what it says before it opens its log file
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout
        while not answers(self.url):  # readiness poll, not a timing assumption
            if self.proc.poll() is not None:
                raise StartError(
                    f"redis-server exited with {self.proc.returncode} (port {self.port}); "
                    f"log {self.log}:\n{self._log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise StartError(f"redis-server not answering on port {self.port}")
            time.sleep(POLL_S)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.running:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, as a crash; waits until the process is gone."""
        if self.proc is not None and self.running:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """Kill if running, then start again on the same port and directory."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 10 s), then remove the working directory if it made it."""
        if self.proc is not None and self.running:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"
