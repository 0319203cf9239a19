"""DecodeWorker in process (tests/services/workers/conftest.py), behind a real PrefillWorker:
it loads the hand-off (full blocks and tail) from the store and streams the tokens the engine
computes from scratch; without the tail (a redelivery) or without the blocks (gone from the
store) it recomputes them, with the same tokens; a cancel aborts it and frees its blocks."""

from __future__ import annotations

from typing import Any

import pytest
from kvserve.shared.protocol import GenerateRequest, TokenEvent
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.hashing import tail_hash

from tests.services.workers.disagg import Disagg

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt(chat_prompt_ids: list[list[int]]) -> list[int]:
    """A chat prompt whose head (all but the last token) ends in a partial block: a tail."""
    return next(p for p in chat_prompt_ids if len(p) > 2 * BLOCK and (len(p) - 1) % BLOCK)


@pytest.fixture(scope="module")
def expected(services_engine: Any, prompt: list[int]) -> list[int]:
    """The greedy tokens of the prompt computed in one engine from scratch."""
    tokens: list[int] = services_engine.generate([prompt], GREEDY)[0][0]
    return tokens


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def store_tokens(engine: Any) -> int:
    """Prompt tokens the engine has taken from the store so far (blocks and tails)."""
    return int(engine.prefix_cache_stats["hits_tokens_store"])


async def prefill_then_decode(disagg: Disagg, req: GenerateRequest) -> list[TokenEvent]:
    await disagg.prefill_bus.submit(req)
    events = [ev async for ev in await disagg.handoff(req.request_id)]
    await disagg.decode_port.acked(req.request_id)
    return events


async def test_decode_loads_the_handoff_and_streams_the_engines_tokens(
    disagg: Disagg, disagg_engines: tuple[Any, Any], prompt: list[int], expected: list[int]
) -> None:
    _, decode_engine = disagg_engines
    before = store_tokens(decode_engine)
    events = await prefill_then_decode(disagg, GenerateRequest("d1", prompt, GREEDY))
    assert tokens_of(events) == expected
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1].finish_reason == "length" and events[-1].error is None
    assert {(e.num_prompt_tokens, e.num_cached_tokens) for e in events} == {(len(prompt), 0)}
    # The client is told what prefill found (nothing, in any tier); the lookup is decode's own.
    assert all(e.cached_tokens_by_source == {"device": 0, "host": 0, "store": 0} for e in events)
    assert {e.store_lookup for e in events} == {"hit"}
    # Every prompt token but the last came from the store: the full blocks and the tail.
    assert store_tokens(decode_engine) - before == len(prompt) - 1
    head = len(prompt) - 1
    tail = tail_hash("d1", prompt[head // BLOCK * BLOCK : head], BLOCK)
    assert tail not in disagg.store.hashes()  # read once, then deleted
    assert disagg.prefill_port.acks == ["d1"] and disagg.decode_port.acks == ["d1"]
    assert decode_engine.kv.pool.num_used == 0 and not decode_engine.has_unfinished_requests()


async def test_a_redelivered_handoff_recomputes_the_tail_it_no_longer_finds(
    disagg: Disagg, disagg_engines: tuple[Any, Any], prompt: list[int], expected: list[int]
) -> None:
    _, decode_engine = disagg_engines
    await prefill_then_decode(disagg, GenerateRequest("d2", prompt, GREEDY))
    (handoff,) = disagg.forwarded
    misses = decode_engine.kv.connector.counters["tail_misses"]
    again = [ev async for ev in await disagg.decode_bus.submit(handoff)]  # as a redelivery
    assert tokens_of(again) == expected
    assert decode_engine.kv.connector.counters["tail_misses"] == misses + 1
    assert disagg.decode_port.acks == ["d2", "d2"]


async def test_a_handoff_whose_blocks_left_the_store_is_recomputed(
    disagg: Disagg, disagg_engines: tuple[Any, Any], prompt: list[int], expected: list[int]
) -> None:
    _, decode_engine = disagg_engines

    async def evict_everything(req: GenerateRequest) -> None:
        await disagg.store.delete(list(disagg.store.hashes()))

    disagg.before_forward = evict_everything
    before = store_tokens(decode_engine)
    misses = decode_engine.kv.connector.counters["tail_misses"]
    events = await prefill_then_decode(disagg, GenerateRequest("d3", prompt, GREEDY))
    assert tokens_of(events) == expected
    assert store_tokens(decode_engine) == before  # nothing came from the store
    assert decode_engine.kv.connector.counters["tail_misses"] == misses + 1


async def test_a_cancelled_decode_is_aborted_and_frees_its_blocks(
    disagg: Disagg, disagg_engines: tuple[Any, Any], prompt: list[int]
) -> None:
    _, decode_engine = disagg_engines
    long = SamplingParams(max_tokens=500, ignore_eos=True)
    await disagg.prefill_bus.submit(GenerateRequest("d4", prompt, long))
    events = aiter(await disagg.handoff("d4"))
    first = await anext(events)
    assert first.token_ids and decode_engine.kv.pool.num_used > 0
    await disagg.decode_bus.cancel("d4")
    rest = [ev async for ev in events]
    assert rest[-1].error is not None and rest[-1].error.type == "cancelled"
    assert len(tokens_of([first, *rest])) < 500
    await disagg.decode_port.acked("d4")
    await disagg.decode.engine.call(lambda: None)  # the abort has been applied
    assert decode_engine.kv.pool.num_used == 0 and not decode_engine.has_unfinished_requests()
    assert disagg.decode_port.acks == ["d4"]
