"""AsyncEngine: concurrent requests stream their tokens; a consumer that stops aborts; a built
engine is made on the thread that steps it."""

from __future__ import annotations

import asyncio
import threading

import pytest
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.engine.engine import Engine
from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


async def collect(engine: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(rid, prompt, PARAMS):
        tokens += out.completions[0].token_ids
    return tokens


async def test_concurrent_requests_match_sync_engine(make_engine, chat_prompt_ids) -> None:  # type: ignore[no-untyped-def]
    prompts = chat_prompt_ids[:4]
    expected = [c[0] for c in make_engine().generate(prompts, PARAMS)]
    engine = AsyncEngine(make_engine())
    try:
        got = await asyncio.gather(*(collect(engine, f"r{i}", p) for i, p in enumerate(prompts)))
    finally:
        engine.stop()
    assert got == expected


async def test_consumer_that_stops_aborts_and_frees_blocks(make_engine, chat_prompt_ids) -> None:  # type: ignore[no-untyped-def]
    inner = make_engine()
    engine = AsyncEngine(inner)
    try:
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = engine.generate("cancel-me", chat_prompt_ids[0], long)
        first = await stream.__anext__()
        assert first.completions[0].token_ids
        await stream.aclose()  # the client went away
        # The abort travels to the engine thread; a later request completes after it.
        assert len(await collect(engine, "after", chat_prompt_ids[1])) == PARAMS.max_tokens
    finally:
        engine.stop()
    assert not inner.has_unfinished_requests()
    assert inner.kv.pool.num_free == inner.kv.pool.num_blocks


async def test_invalid_request_raises_before_streaming(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = AsyncEngine(make_engine())
    try:
        with pytest.raises(InvalidRequestError) as e:
            async for _ in engine.generate("bad", [], PARAMS):
                pass
        assert e.value.param == "prompt"
    finally:
        engine.stop()


async def test_a_built_engine_is_made_and_stepped_on_one_thread(
    make_engine, chat_prompt_ids
) -> None:  # type: ignore[no-untyped-def]
    """`AsyncEngine.build`: the engine is made on the thread that steps it (one pool of torch
    compute threads, not one for the loading thread and one for the stepping thread)."""
    made_on: list[threading.Thread] = []

    def make() -> Engine:
        made_on.append(threading.current_thread())
        return make_engine()

    engine = AsyncEngine.build(make)
    try:
        assert made_on[0] is not threading.current_thread()
        stepped_on = await engine.call(threading.current_thread)
        assert made_on == [stepped_on] and stepped_on.name == "kvserve-engine"
        assert len(await collect(engine, "r", chat_prompt_ids[0])) == PARAMS.max_tokens
    finally:
        engine.stop()
    assert not made_on[0].is_alive()


def test_building_raises_what_making_the_engine_raised() -> None:
    def make() -> Engine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(make)


@pytest.mark.parametrize(("before", "after"), [(0.005, 0.0005), (0.0001, 0.0001)])
async def test_stepping_shortens_the_gil_switch_interval_but_never_lengthens_it(
    make_engine, before: float, after: float
) -> None:  # type: ignore[no-untyped-def]
    """Once the engine thread steps, a thread that wants the GIL back (the engine's, after a
    kernel) waits at most 0.5 ms for one running Python; a shorter interval the process set
    is kept."""
    import sys

    saved = sys.getswitchinterval()
    sys.setswitchinterval(before)
    engine = AsyncEngine(make_engine())
    try:
        engine.start()
        interval = await engine.call(sys.getswitchinterval)  # once the thread runs
        assert interval == pytest.approx(after)
    finally:
        engine.stop()
        sys.setswitchinterval(saved)
