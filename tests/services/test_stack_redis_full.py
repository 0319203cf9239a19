"""A full Redis evicts only recomputable data. compose.yaml's two redis-servers, started with its
own flags and smaller bounds (the bus with `noeviction`, the store an `allkeys-lru` cache), under
a real `kvserve stack --workers 2 --store-redis`; long distinct prompts, each sent twice, write
five times the store's bound. Every request is answered with the greedy text of a calm run (the
engine in this process, no store), the store evicted blocks and stayed at its bound, and the bus
lost nothing: the idle shared request stream and both workers' own streams keep their consumer
group, both registrations remain (on one such Redis for both, the workers' streams and the
registrations were evicted and the gateway answered 503). See docs/deployment.md, "Redis memory
policy"."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import redis
import yaml
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import free_port
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.bench.lib.redis_server import RedisServer, redis_binaries_present
from kvserve.shared.engine.kv.connector import FETCH_BATCH
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams

from tests.services.server_state import kill_stack

pytestmark = [pytest.mark.redis, pytest.mark.slow]  # a real stack: ~20 s

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ("worker-0", "worker-1")
STORE_MAXMEMORY = 24 * 2**20  # ~36 native frames of this model (16 tokens, fp32 K/V: ~0.7 MB)
BUS_MAXMEMORY = 64 * 2**20
PROMPTS = 6  # ~480 tokens (30 blocks) each: 180 frames, ~120 MB, five times the store's bound
MAX_TOKENS = 8
# What the store may use beyond maxmemory: Redis evicts before each write, so the last frame
# written and the frames the workers' connections are receiving sit above the bound (1 MB seen).
STORE_SLACK = 4 * 2**20
CLIENTS = 3  # requests at once: each may be loading its prefix
# At its peak, beside the data: a load's MGET reply, built whole in its connection's output
# buffer (FETCH_BATCH native frames of 16 tokens, fp32 K/V of 30 layers x 3 heads x 64) while
# the worker reads it, one per request loading.
REPLY_BYTES = FETCH_BATCH * 16 * 2 * 30 * 3 * 64 * 4


def compose_redis(service: str, maxmemory: int) -> RedisServer:
    """A redis-server with compose.yaml's flags for `service` (its policy, no persistence), with
    `maxmemory` for compose's bound."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    command = [str(c) for c in compose["services"][service]["command"]]
    assert command[0] == "redis-server"
    flags = command[1:]
    flags[flags.index("--maxmemory") + 1] = str(maxmemory)
    return RedisServer(extra_args=flags)


def prompt(i: int) -> str:
    """A long prompt that shares no block with the others (it differs from the first token)."""
    items = " ".join(f"parcel {i}-{j} weighs {(i * 31 + j * 7) % 97} grams;" for j in range(40))
    return f"Ledger {i}. {items} The heaviest parcel of ledger {i} is"


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    bus, store = compose_redis("bus", BUS_MAXMEMORY), compose_redis("store", STORE_MAXMEMORY)
    try:
        bus.start()
        store.start()
        yield bus, store
    finally:
        bus.stop()
        store.stop()


def test_a_full_store_evicts_blocks_never_the_bus(
    model_path: Path,
    tmp_path: Path,
    servers: tuple[RedisServer, RedisServer],
    services_engine: Any,
    tokenizer: KVTokenizer,
) -> None:
    bus_server, store_server = servers
    bus = redis.Redis.from_url(bus_server.url, decode_responses=True)
    store = redis.Redis.from_url(store_server.url)
    assert bus.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    assert store.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
    texts = [prompt(i) for i in range(PROMPTS)]
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    # The answers of a calm run: the engine in this process, no store.
    calm = [tokenizer.decode(services_engine.generate([tokenizer.encode(t)], greedy)[0][0])
            for t in texts]  # fmt: skip
    port = free_port()
    # Native frames: an answer from loaded blocks equals recomputation's.
    argv = [sys.executable, "-m", "kvserve.services.cli", "stack", "--redis", bus_server.url,
            "--store-redis", store_server.url, "--workers", "2", "--port", str(port),
            "--model", str(model_path), "--metrics-port", "0", "--store-format", "native",
            "--grace", "20"]  # fmt: skip
    log = tmp_path / "stack.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    children: list[psutil.Process] = []
    try:
        stack = psutil.Process(proc.pid)
        children = poll_until(lambda: [*stack.children()] if len(stack.children()) == 3 else [])
        http = Http(f"http://127.0.0.1:{port}")

        def ready() -> bool:
            try:
                registered = set(bus.zrange("kvserve:workers", 0, -1))
                return registered >= set(WORKERS) and http.get("/ready").status_code == 200
            except OSError:  # the gateway is not listening yet
                return False

        poll_until(ready, timeout=240, interval=0.25)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300
        )
        model = client.models.list().data[0].id

        def complete(text: str) -> str:
            r = client.completions.create(
                model=model, prompt=text, max_tokens=MAX_TOKENS, temperature=0
            )
            return r.choices[0].text

        # Twice over: the second pass finds some blocks in the workers, some in the store and
        # some evicted (recomputed).
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            for _ in range(2):
                assert list(pool.map(complete, texts)) == calm

        stats = store.info("stats")
        memory = store.info("memory")
        assert stats["evicted_keys"] > 0, "the store never reached its bound"
        assert memory["used_memory"] <= STORE_MAXMEMORY + STORE_SLACK
        assert memory["used_memory_peak"] <= STORE_MAXMEMORY + STORE_SLACK + CLIENTS * REPLY_BYTES
        # The bus: nothing evicted, every stream with its group, every registration.
        assert bus.info("stats")["evicted_keys"] == 0
        for key in ("kvserve:prefill", *(f"kvserve:to:{w}" for w in WORKERS)):
            assert [g["name"] for g in bus.xinfo_groups(key)] == ["prefill"], key
        assert set(bus.zrange("kvserve:workers", 0, -1)) >= set(WORKERS)
        assert set(bus.hkeys("kvserve:worker_info")) >= set(WORKERS)
        # Each server holds its own keys only.
        assert not list(bus.scan_iter("kvserve:v1:*", count=1000))
        assert not [k for k in store.scan_iter(count=1000) if not k.startswith(b"kvserve:v1:")]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text(errors="replace")[-4000:]
    finally:
        kill_stack(proc, children)
        bus.close()
        store.close()
