"""The engine against real Redis servers: two engines in separate processes share a prefix
through Redis; a block corrupted by hand inside Redis is detected, deleted and recomputed; a
Redis killed mid-run degrades to recompute and is used again once it is back; a Redis Cluster
works as the store. Store format `native`, so outputs must equal a cold run token for token."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import pytest
import redis
from kvserve.services.bench.lib.redis_cluster import RedisCluster
from kvserve.services.bench.lib.redis_server import RedisServer
from kvserve.shared.config import StoreConfig
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.base import block_key
from kvserve.shared.store.hashing import block_hashes

from tests.shared.engine.helpers import run_one

pytestmark = pytest.mark.redis

LOCAL = "redis://127.0.0.1:6379/15"
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
LONG = "Please read this carefully: the quick brown fox jumps over the lazy dog. " * 6


def chat(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return list(tokenizer.encode_chat([{"role": "user", "content": text}]))


def cold(make_engine, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    return make_engine(enable_prefix_caching=False).generate([prompt], GREEDY)[0][0]


def namespace_url(base: str, **params: object) -> str:
    query = "&".join(
        f"{k}={v}" for k, v in {"namespace": f"t-{uuid.uuid4().hex}", **params}.items()
    )
    return f"{base}?{query}"


@pytest.mark.slow  # ~45 s: two model loads in two processes
def test_two_processes_share_a_prefix(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    url = namespace_url(LOCAL)
    prompt = LONG + "What animal jumps?"
    cmd = [sys.executable, "-m", "kvserve.services.cli", "generate", prompt]
    cmd += ["--max-tokens", "8", "--store", url]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=True)
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=True)
    cached = [int(re.search(r"\((\d+) cached\)", p.stderr).group(1)) for p in (first, second)]  # type: ignore[union-attr]
    ids = chat(tokenizer, prompt)
    assert cached == [0, ((len(ids) - 1) // 16) * 16]
    expected = tokenizer.decode(make_engine().generate([ids], SamplingParams(max_tokens=8))[0][0])
    assert first.stdout == second.stdout == expected + "\n"


@pytest.mark.slow  # the default run stays within its time on the slowest CPUs
def test_block_corrupted_in_redis_is_recomputed(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    url = namespace_url(LOCAL)
    ns = url.split("namespace=")[1]
    prompt = chat(tokenizer, LONG + "Which dog?")
    a = make_engine(store=StoreConfig(url))
    reference, _ = run_one(a, "a", prompt, GREEDY)
    a.close()
    hashes = block_hashes(a.root_hash(), prompt[: ((len(prompt) - 1) // 16) * 16], 16)
    r = redis.Redis.from_url(LOCAL)
    key = block_key(hashes[1], ns)
    frame = bytearray(r.get(key))  # type: ignore[arg-type]
    frame[-40] ^= 0xFF  # inside the payload, before the checksum field
    r.set(key, bytes(frame))
    b = make_engine(store=StoreConfig(url))
    try:
        tokens, cached = run_one(b, "b", prompt, GREEDY)
        assert tokens == reference == cold(make_engine, prompt)
        assert cached == 16  # block 0 loaded; block 1 rejected, it and the rest recomputed
        assert sum(b.store_stats()["miss_reasons"].values()) == 1
        b.kv.connector.flush()
        assert r.get(key) not in (None, bytes(frame))  # deleted, then republished by b
    finally:
        b.close()
        r.close()


@pytest.mark.slow  # the default run stays within its time on the slowest CPUs
def test_redis_killed_mid_run_then_back(make_engine, tokenizer, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    url = namespace_url(redis_server.url, timeout=0.3, cooldown=0.2, failures=2, attempts=1)
    store = StoreConfig(url)
    a = make_engine(store=store)
    # Raw prompts (the chat template would add a shared system prompt) that differ from their
    # first block on: nothing of one is cached for another.
    prompts = [list(tokenizer.encode(f"Question number {i}. " + LONG)) for i in range(12)]
    try:
        run_one(a, "p0", prompts[0], GREEDY)
        assert a.kv.connector is not None and a.kv.connector.flush()
        assert a.store_stats()["published_blocks"] > 0
        redis_server.kill()
        # Requests keep completing, by recompute, with the right output.
        b = make_engine(store=store)
        try:
            tokens, cached = run_one(b, "p0-b", prompts[0], GREEDY)
            assert tokens == cold(make_engine, prompts[0])
            assert cached == 0
            tokens, _ = run_one(a, "p1", prompts[1], GREEDY)
            assert tokens == cold(make_engine, prompts[1])
        finally:
            b.close()
        redis_server.restart()  # empty: no persistence
        # Without restarting the engine, its writes reach the store again once the breaker's
        # probe succeeds (cooldown 0.2 s): each try computes a new prompt and flushes.
        published = a.store_stats()["published_blocks"]
        for i in range(2, len(prompts)):
            tokens, _ = run_one(a, f"p{i}", prompts[i], GREEDY)
            a.kv.connector.flush()
            if a.store_stats()["published_blocks"] > published:
                break
        else:
            pytest.fail("the engine never wrote to the restarted Redis")
        c = make_engine(store=store)
        try:
            again, cached = run_one(c, "c", prompts[i], GREEDY)
            assert again == tokens
            assert cached == ((len(prompts[i]) - 1) // 16) * 16
            assert c.prefix_cache_stats["hits_tokens_store"] == cached
        finally:
            c.close()
    finally:
        a.close()


def test_engine_on_redis_cluster(make_engine, tokenizer, redis_cluster: RedisCluster) -> None:  # type: ignore[no-untyped-def]
    store = StoreConfig(namespace_url(redis_cluster.url))
    prompt = chat(tokenizer, LONG + "Is the fox quick?")
    a = make_engine(store=store)
    reference, _ = run_one(a, "a", prompt, GREEDY)
    a.close()
    b = make_engine(store=store)
    try:
        tokens, cached = run_one(b, "b", prompt, GREEDY)
        assert tokens == reference
        assert cached == ((len(prompt) - 1) // 16) * 16
        assert b.prefix_cache_stats["hits_tokens_store"] == cached
    finally:
        b.close()
