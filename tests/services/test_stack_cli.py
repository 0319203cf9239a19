"""`kvserve stack --redis URL` end to end: it starts a gateway, two prefill workers and a decode
worker on a throwaway redis-server, serves a chat request through the official `openai` client,
and on SIGINT (Ctrl-C) stops every process it started."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import openai
import psutil
import pytest
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import free_port
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.bench.lib.redis_server import RedisServer, redis_binaries_present

# slow: ~25-40 s for a path test_stack_e2e.py already covers process by process.
pytestmark = [pytest.mark.redis, pytest.mark.slow]


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

        def ready() -> bool:
            try:
                return http.get("/ready").status_code == 200
            except OSError:  # the gateway is not listening yet
                return False

        poll_until(ready, timeout=240, interval=0.25)
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
        for c in children:
            if c.is_running():
                c.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        redis.stop()
