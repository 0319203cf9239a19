"""What a running kvserve server shows, for the service tests: the workers' summed engine
counters, the moment it is idle, the spans its file exporter wrote. The server itself is a
`ServerProcess` of the shared harness (kvserve.services.bench.lib.process); plain HTTP calls
are its `Http` (kvserve.services.bench.lib.http)."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import psutil
from kvserve.services.bench.lib.http import Http


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


def read_to_end(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Everything the connection still delivers, until the server's side has closed it."""
    sock.settimeout(timeout)
    data = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    return bytes(data)


def kill_stack(proc: subprocess.Popen[Any], children: list[psutil.Process]) -> None:
    """Kill what is left of a `kvserve stack` process and the children it started."""
    for c in children:
        if c.is_running():
            c.kill()
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
