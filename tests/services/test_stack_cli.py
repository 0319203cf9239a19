"""`kvserve stack --redis URL` end to end: it starts a gateway, two prefill workers and a decode
worker on a throwaway redis-server, serves a chat request through the official `openai` client,
and on SIGINT (Ctrl-C) stops every process it started."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import redis as redis_client
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import free_port
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.bench.lib.redis_server import RedisServer, redis_binaries_present

from tests.services.server_state import kill_stack

# slow: ~25-40 s for a path test_stack_e2e.py already covers process by process.
pytestmark = [pytest.mark.redis, pytest.mark.slow]


def ready(http: Http) -> bool:
    try:
        return http.get("/ready").status_code == 200
    except OSError:  # the gateway is not listening yet
        return False


def test_stack_serves_and_stops_on_sigint(model_path: Path) -> None:
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    redis = RedisServer()
    redis.start()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.services.cli", "stack", "--redis", redis.url,
         "--port", str(port), "--model", str(model_path), "--metrics-port", "0",
         "--grace", "20"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    children: list[psutil.Process] = []
    try:
        stack = psutil.Process(proc.pid)
        children = poll_until(lambda: [*stack.children()] if len(stack.children()) == 4 else [])
        http = Http(f"http://127.0.0.1:{port}")
        poll_until(lambda: ready(http), timeout=240, interval=0.25)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=3,
            temperature=0,
        )
        assert r.choices[0].message.content and r.usage is not None
        assert r.usage.completion_tokens == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"still running after SIGINT: {alive}"
    finally:
        kill_stack(proc, children)
        redis.stop()


def free_port_pair() -> int:
    """A free port whose successor is free too (the two workers' metrics ports)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two consecutive free ports")


def worker_pids(stack: psutil.Process) -> dict[str, int]:
    """The running worker processes' pids by their --name."""
    out = {}
    for child in stack.children():
        with contextlib.suppress(psutil.NoSuchProcess):
            cmd = child.cmdline()
            if "worker" in cmd and child.status() != psutil.STATUS_ZOMBIE:
                out[cmd[cmd.index("--name") + 1]] = child.pid
    return out


def metrics(port: int) -> str | None:
    """A worker's /metrics text; None while nothing answers on its port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())
    except OSError:
        return None


def test_stack_restarts_a_worker_killed_mid_stream(model_path: Path, tmp_path: Path) -> None:
    """`--workers 2`: SIGKILL the worker streaming a request. The gateway stays up, the stack
    logs the exit and starts the worker again under its name and metrics port (a new pid that
    heartbeats on the bus), the stream finishes with the text a fresh request gets (the take-over
    is token-exact), and later requests are answered."""
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    redis = RedisServer()
    redis.start()
    port, metrics_port = free_port(), free_port_pair()
    log = tmp_path / "stack.stderr"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.services.cli", "stack", "--redis", redis.url,
             "--port", str(port), "--model", str(model_path), "--workers", "2",
             "--metrics-port", str(metrics_port), "--grace", "20"],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    ports = {f"worker-{i}": metrics_port + i for i in range(2)}
    stack = psutil.Process(proc.pid)
    try:
        pids = poll_until(lambda: len(worker_pids(stack)) == 2 and worker_pids(stack), timeout=30)
        http = Http(f"http://127.0.0.1:{port}")
        poll_until(lambda: all(metrics(p) for p in ports.values()), timeout=240, interval=0.25)
        poll_until(lambda: ready(http), timeout=60, interval=0.25)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        kw: dict[str, Any] = {
            "model": model, "prompt": "Count from one to a hundred: one, two,", "max_tokens": 64,
            "temperature": 0, "extra_body": {"ignore_eos": True},
        }  # fmt: skip
        it = iter(client.completions.create(**kw, stream=True))
        text = next(it).choices[0].text

        def running() -> str | None:
            busy = re.compile(r"^kvserve:num_requests_running\{.*\} [1-9]", re.M)
            return next((n for n, p in ports.items() if busy.search(metrics(p) or "")), None)

        name = poll_until(running, timeout=10)
        killed_at = time.time()
        os.kill(pids[name], signal.SIGKILL)
        text += "".join(c.choices[0].text for c in it)  # taken over once claimable

        def restarted() -> int | None:
            pid = worker_pids(stack).get(name)
            return pid if pid not in (None, pids[name]) and metrics(ports[name]) else None

        poll_until(restarted, timeout=240, interval=0.25)
        bus = redis_client.Redis.from_url(redis.url)
        poll_until(lambda: (bus.zscore("kvserve:workers", name) or 0) > killed_at, timeout=30)
        bus.close()
        assert proc.poll() is None and ready(http)
        fresh = client.completions.create(**kw)
        assert fresh.usage is not None and fresh.usage.completion_tokens == 64
        assert text == fresh.choices[0].text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        lines = log.read_text().splitlines()
        exited = f"kvserve stack: {name} exited with code -9 (SIGKILL); restarting it in 1 s"
        assert [ln for ln in lines if "exited with code" in ln] == [f"{exited} (restart 1)"]
    finally:
        children = stack.children(recursive=True) if proc.poll() is None else []
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for c in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                c.kill()
        redis.stop()
