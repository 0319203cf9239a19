"""Prefix caching in the engine: warm outputs identical to cold, cached-token accounting, salts,
eviction pressure, and that the last prompt token is always computed."""

from __future__ import annotations

import pytest
from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams

from tests.shared.engine.helpers import run_one

# Read by the `prompts` and `cold` fixtures (tests/conftest.py): SYSTEM with each of QUESTIONS
# as a chat, and their outputs under GREEDY with prefix caching off.
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6
QUESTIONS = ["What is 2+2?", "Name a color.", "Say hello.", "What is the capital of Italy?"]


def test_warm_equals_cold_match_mid_prompt(make_engine, prompts, cold) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    bs = engine.block_size
    tokens, cached = run_one(engine, "a", prompts[0], GREEDY)
    assert tokens == cold[0] and cached == 0
    tokens, cached = run_one(engine, "b", prompts[1], GREEDY)
    assert tokens == cold[1]
    common = next(i for i, (x, y) in enumerate(zip(prompts[0], prompts[1], strict=False)) if x != y)
    assert cached == (common // bs) * bs > 0  # every full block of the shared prefix, no more
    stats = engine.prefix_cache_stats
    assert stats["queries_tokens"] == len(prompts[0]) + len(prompts[1])
    assert stats["hits_tokens"] == cached


def test_whole_prompt_cached_still_computes_last_token(make_engine, prompts, cold) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    bs = engine.block_size
    run_one(engine, "a", prompts[2], GREEDY)
    tokens, cached = run_one(engine, "b", prompts[2], GREEDY)
    assert tokens == cold[2]
    assert cached == ((len(prompts[2]) - 1) // bs) * bs
    # A prompt of exactly whole blocks: the last block is recomputed, not matched.
    exact = prompts[2][: (len(prompts[2]) // bs) * bs]
    run_one(engine, "c", exact, GREEDY)
    _, cached = run_one(engine, "d", exact, GREEDY)
    assert cached == len(exact) - bs


def test_salts_isolate_tenants(make_engine, prompts, cold) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    run_one(engine, "a", prompts[0], GREEDY, cache_salt="tenant-a")
    tokens, cached = run_one(engine, "b", prompts[0], GREEDY, cache_salt="tenant-b")
    assert cached == 0 and tokens == cold[0]
    tokens, cached = run_one(engine, "c", prompts[0], GREEDY, cache_salt="tenant-a")
    assert cached > 0 and tokens == cold[0]
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", prompts[0], GREEDY, cache_salt="no spaces allowed")
    assert e.value.param == "cache_salt"


def test_eviction_pressure_keeps_outputs_exact(make_engine, prompts, cold) -> None:  # type: ignore[no-untyped-def]
    longest = max(len(p) for p in prompts) + GREEDY.max_tokens
    engine = make_engine(num_blocks=(longest // 16 + 1) + 2)  # room for about one request
    for round_ in range(2):
        for i, p in enumerate(prompts):
            tokens, _ = run_one(engine, f"r{round_}-{i}", p, GREEDY)
            assert tokens == cold[i]
    assert engine.prefix_cache_stats["evicted_blocks"] > 0
    assert engine.prefix_cache_stats["hits_tokens"] > 0
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    engine.kv.pool.check()


def test_concurrent_batch_with_shared_prefix(make_engine, prompts, cold) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    run_one(engine, "warm", prompts[3], GREEDY)
    out = engine.generate(prompts, GREEDY)
    assert [o[0] for o in out] == cold
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_step_with_only_a_prompt_chunk(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A step that samples nothing (one long prompt, chunked) produces no output."""
    engine = make_engine(max_num_batched_tokens=32, max_prefill_chunk=32)
    prompt = tokenizer.encode(SYSTEM)
    assert len(prompt) > 32
    engine.add_request("long", prompt, GREEDY)
    assert engine.step() == []
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
