"""Engine pieces of the cache admin API and top-k logprobs: `reset_prefix_cache` drops the
device prefix cache and the host tier; `AsyncEngine.call` runs a warm-up on the engine thread
while other requests keep streaming; the sampler's top alternatives under greedy."""

from __future__ import annotations

import asyncio

from kvserve.shared.config import StoreConfig
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.protocol import AdminRequest, ProtocolError, TokenEvent, decode, encode
from kvserve.shared.sampling_params import SamplingParams

from tests.engine.helpers import long_ids, run_one


def test_top_logprobs_greedy(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(num_blocks=64)
    params = SamplingParams(max_tokens=5, logprobs=True, top_logprobs=4, ignore_eos=True)
    engine.add_request("r", long_ids(tokenizer, 1)[:40], params)
    tokens, lps, tops = [], [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            for d in out.completions:
                tokens += d.token_ids
                lps += d.logprobs
                tops += d.top_logprobs
    assert len(tokens) == len(lps) == len(tops) == 5
    for tok, lp, top in zip(tokens, lps, tops, strict=True):
        assert len(top) == 4 and list(top.values()) == sorted(top.values(), reverse=True)
        assert next(iter(top)) == tok and top[tok] == lp == max(top.values())
    plain = SamplingParams(max_tokens=2, logprobs=True)
    engine.add_request("p", long_ids(tokenizer, 1)[:40], plain)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert all(d.top_logprobs == [] for d in out.completions)


def test_reset_prefix_cache(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(num_blocks=64, store=StoreConfig(url="memory://"))
    prompt = long_ids(tokenizer, 2)[:70]
    params = SamplingParams(max_tokens=1)

    def cached() -> int:
        return run_one(engine, "c", prompt, params)[1]

    assert cached() == 0
    assert cached() == 64
    engine.warmup(long_ids(tokenizer, 3)[:40], None, "w")  # pins 2 blocks in the host tier
    got = engine.reset_prefix_cache()
    assert got["device_blocks"] >= 4 and got["host_blocks"] >= 2
    assert engine.kv.pool.index is not None and len(engine.kv.pool.index) == 0
    assert engine.kv.host_tier is not None and len(engine.kv.host_tier) == 0
    engine.kv.pool.check()
    assert engine.reset_prefix_cache() == {"device_blocks": 0, "host_blocks": 0}
    engine.close()


async def test_call_runs_a_warmup_while_requests_stream(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    inner = make_engine(num_blocks=128, store=StoreConfig(url="memory://"))
    engine = AsyncEngine(inner)
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    async def generate() -> int:
        n = 0
        async for out in engine.generate("g", long_ids(tokenizer, 4)[:30], params):
            n += len(out.completions[0].token_ids)
        return n

    try:
        task = asyncio.create_task(generate())
        await asyncio.sleep(0)  # the request reaches the engine first
        got = await engine.call(lambda: inner.warmup(long_ids(tokenizer, 5)[:48], None, "w"))
        assert got["blocks"] == 3 and got["computed"] == 1
        assert await asyncio.wait_for(task, 120) == 24
        assert await engine.call(lambda: 7) == 7
        try:
            await engine.call(lambda: 1 / 0)
        except ZeroDivisionError:
            pass
        else:
            raise AssertionError("the callable's exception must reach the caller")
    finally:
        engine.stop()
        inner.close()


def test_admin_and_top_logprobs_messages_round_trip() -> None:
    job = AdminRequest("w1", "warmup", [{"token_ids": [1, 2], "cache_salt": None}])
    assert decode(encode(job)) == job
    ev = TokenEvent("w1", 0, info={"done": 1}, top_logprobs=[[[5, -0.1], [7, -2.5]]])
    assert decode(encode(ev)) == ev
    for bad in (
        AdminRequest("x", "explode"),
        AdminRequest("x", "warmup", [{"token_ids": ["a"]}]),
        AdminRequest("x", "warmup", [{"token_ids": [1], "other": 1}]),
    ):
        try:
            decode(encode(bad))
        except ProtocolError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_store_latency_stats_and_metrics() -> None:
    from kvserve.shared.store.tiers import LatencyStats
    from kvserve.shared.telemetry import EngineStatsCollector
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    lat = LatencyStats((0.01, 0.1))
    lat.observe("get", 0.005)
    lat.observe("get", 0.05)
    lat.observe("get", 5.0)
    lat.error("put")
    with lat.time("put"):
        pass
    try:
        with lat.time("put"):
            raise OSError("store down")
    except OSError:
        pass
    snap = lat.snapshot()
    assert snap["bounds"] == [0.01, 0.1]
    assert snap["get"]["counts"] == [1, 1, 1] and snap["get"]["count"] == 3
    assert snap["put"]["count"] == 1 and snap["put"]["errors"] == 2
    collector = EngineStatsCollector("m")
    collector.snapshot = {"w0": {"store_latency": snap}}
    registry = CollectorRegistry()
    registry.register(collector)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    get = {(s.name, s.labels.get("le")): s.value for s in fams["kvserve:store_get_seconds"].samples}
    assert get[("kvserve:store_get_seconds_bucket", "0.01")] == 1
    assert get[("kvserve:store_get_seconds_bucket", "0.1")] == 2
    assert get[("kvserve:store_get_seconds_bucket", "+Inf")] == 3
    assert get[("kvserve:store_get_seconds_count", None)] == 3
    errors = {s.labels["op"]: s.value for s in fams["kvserve:store_errors"].samples}
    assert errors == {"get": 0, "put": 2}
