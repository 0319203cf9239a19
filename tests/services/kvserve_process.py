"""`kvserve serve` as a real subprocess for the service tests, and small HTTP helpers (plain
calls, the cache stats, polling a condition).

`ServeProcess` starts `kvserve serve --port 0 ...`, reads its JSON log lines on a thread, and
waits (under a deadline) for the `ready` event, which carries the bound URL: no sleeping, no
port guessing. Its log lines stay readable for the tests (`events()`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 180.0


class ServeProcess:
    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        command: tuple[str, ...] = ("serve", "--port", "0"),
    ) -> None:
        """`command`: the subcommand and its leading flags (any command that logs a `ready`
        event with a `url`: serve, gateway, prefill, decode)."""
        cmd = [sys.executable, "-m", "kvserve.services.cli", *command, *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self.url = ""
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._lock:
                self.lines.append(line)
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and event.get("event") == "ready":
                self.url = event["url"]
                self._ready.set()
        self._ready.set()  # the process ended: wake the waiter

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServeProcess:
        if not self._ready.wait(timeout) or not self.url:
            self.kill()
            raise RuntimeError("kvserve did not become ready:\n" + "".join(self.lines[-30:]))
        return self

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            lines = list(self.lines)
        out = []
        for line in lines:
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(e, dict):
                out.append(e)
        return out

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(5)


class Reply:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code = status
        self.headers = headers
        self.content = body

    @property
    def text(self) -> str:
        return self.content.decode()

    def json(self) -> Any:
        return json.loads(self.content)


class Http:
    """A few plain HTTP calls (urllib) for what the openai client does not cover."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url
        self.headers = headers or {}

    def request(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        data = content if json_body is None else json.dumps(json_body).encode()
        hdrs = {**self.headers, **(headers or {})}
        if json_body is not None:
            hdrs.setdefault("Content-Type", "application/json")
        req = urllib.request.Request(self.base_url + path, data, hdrs, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return Reply(r.status, dict(r.headers), r.read())
        except urllib.error.HTTPError as e:
            return Reply(e.code, dict(e.headers), e.read())

    def get(self, path: str, **kw: Any) -> Reply:
        return self.request("GET", path, **kw)

    def post(self, path: str, json: Any = None, **kw: Any) -> Reply:
        return self.request("POST", path, json_body=json, **kw)


def cache_totals(http: Http) -> dict[str, Any]:
    """The workers' summed engine counters (GET /v1/cache/stats `totals`)."""
    r = http.get("/v1/cache/stats")
    assert r.status_code == 200, r.text
    return dict(r.json()["totals"])


def idle(http: Http) -> dict[str, Any] | None:
    """The cache totals once nothing runs or waits, no block is referenced and the gateway has
    nothing in flight; None before."""
    stats = http.get("/v1/cache/stats").json()
    t = stats["totals"]
    quiet = not (t["num_requests_running"] or t["num_requests_waiting"] or t["num_used_blocks"])
    return dict(t) if quiet and stats["gateway"]["in_flight"] == 0 else None


def read_spans(path: Path) -> list[dict[str, Any]]:
    """The spans a server's file exporter has written to `path` (one JSON object a line), without
    a last line it is still writing."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # the part after the last newline is unfinished
    return [json.loads(line) for line in lines if line.strip()]


def poll_until(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Re-evaluate `check` until it returns something truthy (a condition on observable state,
    under a deadline); fail with the last value otherwise."""
    deadline = time.monotonic() + timeout
    value = check()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s (last: {value!r})")
        time.sleep(interval)
        value = check()
    return value
