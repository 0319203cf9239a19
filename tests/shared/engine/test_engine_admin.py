"""Engine pieces of the cache admin API and top-k logprobs: `reset_prefix_cache` drops the
device prefix cache and the host tier; `AsyncEngine.call` runs a warm-up on the engine thread
while other requests keep streaming; the sampler's top alternatives under greedy."""

from __future__ import annotations

import asyncio

from kvserve.shared.config import StoreConfig
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.engine.helpers import long_ids, run_one


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
