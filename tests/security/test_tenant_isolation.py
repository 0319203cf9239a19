"""Tenants never address each other's blocks in the store. The gateway turns each API key into
a cache salt (services/gateway/auth.py: `key-` + 32 hex digits of sha256(key); a client's own
`cache_salt` can only be appended to it), the salt goes into the chain's root hash
(shared/store/hashing.py), and every Redis key of a block is that chain hash.

Against the real Redis on 6379, in a namespace of its own: engines serving the same prompt for
two API keys write disjoint sets of keys (read back with SCAN: exactly the block keys of each
tenant's chain), a lookup under one tenant's salt finds none of the other's blocks (neither in
the store nor through an engine, which recomputes), and the same tenant on a fresh engine does
find its own (the lookup works; the isolation is not a miss of every lookup)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from kvserve.services.bench.lib.redis_server import redis_answers
from kvserve.services.gateway.auth import ApiKeys
from kvserve.shared.config import StoreConfig
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.base import block_key
from kvserve.shared.store.hashing import BlockHash, block_hashes
from kvserve.shared.store.redis import RedisStore

from tests.shared.engine.helpers import run_one

pytestmark = pytest.mark.redis

LOCAL = "redis://127.0.0.1:6379/15"
BLOCK = 16
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)  # computes the prompt, nothing more
TEXT = "Please read this carefully: the quick brown fox jumps over the lazy dog. " * 4
KEYS = ("sk-tenant-a", "sk-tenant-b")


@pytest.fixture
def namespace() -> Iterator[str]:
    if not asyncio.run(redis_answers(LOCAL)):
        pytest.skip(f"no Redis at {LOCAL}")
    ns = f"t-{uuid.uuid4().hex}"
    yield ns
    r = redis.Redis.from_url(LOCAL)
    keys = list(r.scan_iter(match=f"{ns}:*"))
    if keys:
        r.delete(*keys)
    r.close()


def scan(namespace: str) -> set[str]:
    r = redis.Redis.from_url(LOCAL)
    try:
        return {k.decode() for k in r.scan_iter(match=f"{namespace}:*", count=1000)}
    finally:
        r.close()


def keys_of(hashes: list[BlockHash], namespace: str) -> set[str]:
    return {block_key(h, namespace) for h in hashes}


async def stored(url: str, hashes: list[BlockHash]) -> list[bool]:
    store = RedisStore.from_url(url)
    try:
        return await store.contains(hashes)
    finally:
        await store.close()


def serve(make_engine: Callable[..., Any], url: str, prompt: list[int], salt: str) -> int:
    """One request on a fresh engine (nothing cached on its device) that writes its blocks
    through to the store; the prompt tokens it found cached."""
    engine = make_engine(store=StoreConfig(url, format="native"))
    try:
        _, cached = run_one(engine, f"r-{uuid.uuid4().hex[:8]}", prompt, ONE_TOKEN, cache_salt=salt)
        assert engine.kv.connector is not None and engine.kv.connector.flush()
        return cached
    finally:
        engine.close()


def test_two_api_keys_write_disjoint_keys_and_never_read_each_other(
    make_engine: Callable[..., Any], tokenizer: KVTokenizer, namespace: str
) -> None:
    url = f"{LOCAL}?namespace={namespace}"
    keys = ApiKeys(KEYS, allow_client_salt=True)
    salt_a = keys.authenticate(f"Bearer {KEYS[0]}")
    salt_b = keys.authenticate(f"Bearer {KEYS[1]}")
    assert salt_a is not None and salt_b is not None
    prompt = list(tokenizer.encode_chat([{"role": "user", "content": TEXT}]))
    full = len(prompt) // BLOCK
    assert full >= 4
    probe = make_engine(num_blocks=8)
    hashes = {
        salt: block_hashes(probe.root_hash(salt), prompt, BLOCK)
        for salt in (salt_a, salt_b, f"{salt_a}.team-1")
    }
    probe.close()
    assert all(len(h) == full for h in hashes.values())

    keys_a, keys_b = keys_of(hashes[salt_a], namespace), keys_of(hashes[salt_b], namespace)
    assert not keys_a & keys_b

    assert serve(make_engine, url, prompt, salt_a) == 0
    assert scan(namespace) == keys_a
    # A lookup under B's salt (and under A's narrowed by a client salt) finds none of A's.
    assert asyncio.run(stored(url, hashes[salt_b])) == [False] * full
    assert asyncio.run(stored(url, hashes[f"{salt_a}.team-1"])) == [False] * full
    assert asyncio.run(stored(url, hashes[salt_a])) == [True] * full

    assert serve(make_engine, url, prompt, salt_b) == 0  # B recomputes everything
    assert scan(namespace) == keys_a | keys_b

    # The same tenant on a fresh engine finds its own blocks in the store.
    assert serve(make_engine, url, prompt, salt_a) == (len(prompt) - 1) // BLOCK * BLOCK
    assert scan(namespace) == keys_a | keys_b
