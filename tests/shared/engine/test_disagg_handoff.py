"""Prefill -> decode handoff through the store only: the prefill engine computes the prompt
(all but its last token), publishes the full blocks and puts the partial last block under a
per-request key; a decode engine with an empty cache loads both and computes just the last
prompt token, with output identical to a cold run."""

from __future__ import annotations

from pathlib import Path

from kvserve.shared.config import StoreConfig
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.engine.helpers import run_one

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def test_handoff_through_store(make_engine, tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    text = "Tell me about the history of paper making in a few lines. " * 5
    prompt = list(tokenizer.encode_chat([{"role": "user", "content": text}]))
    if (len(prompt) - 1) % 16 == 0:  # make sure there is a partial tail block
        prompt = prompt[:-2] + prompt[-1:]
    cold = make_engine(enable_prefix_caching=False).generate([prompt], GREEDY)[0][0]
    store = StoreConfig(f"file://{tmp_path}")
    head = prompt[:-1]
    full = len(head) // 16 * 16

    pre = make_engine(store=store)
    try:
        pre.add_request("r1", head, SamplingParams(max_tokens=1), export_tail=True)
        outs = []
        while pre.has_unfinished_requests():
            outs += pre.step()
        tail = outs[-1].kv_tail
        assert outs[-1].finished and tail is not None
        assert tail.token_ids == head[full:]
        assert pre.kv.connector is not None and pre.kv.connector.put_tail("r1", tail)
        assert pre.kv.connector.flush()
    finally:
        pre.close()

    dec = make_engine(store=store)
    try:
        assert dec.kv.connector is not None
        got = dec.kv.connector.get_tail("r1", head[full:]).result(timeout=10)
        assert got is not None
        assert dec.kv.connector.get_tail("r1", head[full:]).result(timeout=10) is None  # deleted
        assert dec.kv.connector.get_tail("r2", head[full:]).result(timeout=10) is None
        tokens, cached = run_one(dec, "r1", prompt, GREEDY, kv_tail=got)
        assert tokens == cold
        assert cached == len(prompt) - 1  # only the last prompt token was computed here
        assert dec.prefix_cache_stats["hits_tokens_store"] == len(prompt) - 1
    finally:
        dec.close()


def test_an_abandoned_tail_expires_within_30_s_in_redis(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The tail key of a hand-off whose decode never comes (a decode worker killed before it
    picked the request up) carries a 30 s TTL, while the prompt's full blocks keep the store's."""
    import uuid

    import pytest
    import redis
    from kvserve.shared.engine.kv.connector import TAIL_TTL_S
    from kvserve.shared.store.hashing import tail_hash

    url = f"redis://127.0.0.1:6379/14?namespace=tailttl-{uuid.uuid4().hex[:8]}&ttl=3600"
    client = redis.Redis.from_url("redis://127.0.0.1:6379/14")
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    prompt = list(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4))[:37]
    pre = make_engine(store=StoreConfig(url))
    try:
        pre.add_request("r1", prompt, SamplingParams(max_tokens=1), export_tail=True)
        outs = []
        while pre.has_unfinished_requests():
            outs += pre.step()
        tail = outs[-1].kv_tail
        assert tail is not None and pre.kv.connector is not None
        assert pre.kv.connector.put_tail("r1", tail) and pre.kv.connector.flush()
        store = pre.kv.connector.store
        tail_key = store.key(tail_hash("r1", tail.token_ids, 16))  # type: ignore[attr-defined]
        block_key = store.key(pre.kv.prefix_hashes(prompt, None)[0])  # type: ignore[attr-defined]
        assert 0 < client.ttl(tail_key) <= TAIL_TTL_S == 30
        assert client.ttl(block_key) > TAIL_TTL_S
    finally:
        pre.close()
        keys = list(client.scan_iter(match="*tailttl-*"))
        if keys:
            client.delete(*keys)
