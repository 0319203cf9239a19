"""PrefillWorker in process (tests/services/workers/conftest.py): what it stores, what it
forwards, what it reports as cached, and the requests it ends itself (cancelled, refused, too
late), each acked exactly once and never forwarded."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from kvserve.shared.protocol import GenerateRequest
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.hashing import block_hashes, tail_hash

from tests.services.workers.disagg import NUM_BLOCKS, Disagg

BLOCK = 16
SAMPLING = SamplingParams(max_tokens=4, temperature=0.5, seed=3, stop=("\n",), n=2)


def prompt_of(length: int, start: int = 100) -> list[int]:
    return list(range(start, start + length))


async def test_prefill_stores_the_prompt_and_forwards_the_request(
    disagg: Disagg, disagg_engines: tuple[Any, Any]
) -> None:
    prefill_engine, _ = disagg_engines
    prompt = prompt_of(3 * BLOCK + 5)  # head: 52 tokens = 3 full blocks + a 4-token tail
    req = GenerateRequest("p1", prompt, SAMPLING, cache_salt="tenant-a", deadline=4e9)
    await disagg.prefill_bus.submit(req)
    await disagg.handoff("p1")
    await disagg.prefill_port.acked("p1")
    (fwd,) = disagg.forwarded
    assert (fwd.request_id, fwd.prompt_token_ids, fwd.sampling) == ("p1", prompt, SAMPLING)
    assert (fwd.cache_salt, fwd.deadline, fwd.num_cached_tokens) == ("tenant-a", 4e9, 0)
    assert fwd.submitted_at >= req.submitted_at
    root = prefill_engine.root_hash("tenant-a")
    blocks = block_hashes(root, prompt[: 3 * BLOCK], BLOCK)
    tail = tail_hash("p1", prompt[3 * BLOCK : -1], BLOCK)
    assert disagg.store.hashes() == {*blocks, tail}  # flushed before the hand-off
    assert disagg.prefill_port.acks == ["p1"]
    assert prefill_engine.kv.pool.num_used == 0 and not prefill_engine.has_unfinished_requests()


async def test_a_second_request_reports_the_prefix_it_found_cached(disagg: Disagg) -> None:
    prompt = prompt_of(3 * BLOCK + 5)
    for rid in ("first", "second"):
        await disagg.prefill_bus.submit(GenerateRequest(rid, prompt, SAMPLING))
        await disagg.prefill_port.acked(rid)
    cached = {r.request_id: r.num_cached_tokens for r in disagg.forwarded}
    # The second finds the head's (52 tokens) 3 full blocks in the prefill engine's cache.
    assert cached == {"first": 0, "second": 3 * BLOCK}
    by_tier = {r.request_id: r.cached_tokens_by_source for r in disagg.forwarded}
    assert by_tier == {"first": {"device": 0}, "second": {"device": 3 * BLOCK}}


async def test_a_one_token_prompt_goes_straight_to_decode(disagg: Disagg) -> None:
    await disagg.prefill_bus.submit(GenerateRequest("one", [42], SAMPLING))
    await disagg.prefill_port.acked("one")
    assert [(r.request_id, r.num_cached_tokens) for r in disagg.forwarded] == [("one", 0)]
    assert disagg.forwarded[0].cached_tokens_by_source == {}
    assert disagg.store.hashes() == set()


async def test_refused_requests_end_in_prefill_with_one_error_event(disagg: Disagg) -> None:
    too_long = GenerateRequest("big", prompt_of(20), SamplingParams(max_tokens=NUM_BLOCKS * 16))
    late = GenerateRequest("late", prompt_of(20), SAMPLING, deadline=1.0)
    events = {}
    for req in (too_long, late):
        stream = await disagg.prefill_bus.submit(req)
        events[req.request_id] = [ev async for ev in stream]
        await disagg.prefill_port.acked(req.request_id)
    ((big,), (gone,)) = events["big"], events["late"]
    assert big.error is not None and (big.error.type, big.error.param) == (
        "invalid_request_error",
        "max_tokens",
    )
    assert gone.error is not None and gone.error.type == "timeout"
    assert disagg.forwarded == [] and sorted(disagg.prefill_port.acks) == ["big", "late"]


async def test_a_request_cancelled_before_it_runs_ends_silently(disagg: Disagg) -> None:
    await disagg.prefill_bus.cancel("gone")
    await disagg.prefill_bus.submit(GenerateRequest("gone", prompt_of(40), SAMPLING))
    await disagg.prefill_port.acked("gone")
    assert disagg.forwarded == [] and disagg.prefill_port.acks == ["gone"]
    assert disagg.store.hashes() == set()


async def test_a_request_cancelled_while_its_prompt_computes_is_not_forwarded(
    disagg: Disagg, disagg_engines: tuple[Any, Any]
) -> None:
    """The prompt's blocks are in the store but not in the prefill engine, so the request
    waits in the engine for its store fetch, which the store holds at a gate; the cancel lands
    there, then the gate opens."""
    prefill_engine, _ = disagg_engines
    prompt = prompt_of(3 * BLOCK + 5)
    await disagg.prefill_bus.submit(GenerateRequest("warm", prompt, SAMPLING))
    assert [ev.error async for ev in await disagg.handoff("warm")][-1] is None  # decode idle
    await disagg.prefill.engine.call(prefill_engine.reset_prefix_cache)
    disagg.store.gate = gate = threading.Event()
    await disagg.prefill_bus.submit(GenerateRequest("c", prompt, SAMPLING))
    assert await asyncio.to_thread(disagg.store.at_gate.wait, 60)
    await disagg.prefill_bus.cancel("c")
    await disagg.prefill_port.acked("c")
    gate.set()
    await disagg.prefill.engine.call(lambda: None)  # the abort has been applied
    assert [r.request_id for r in disagg.forwarded] == ["warm"]
    assert disagg.prefill_port.acks == ["warm", "c"]
    assert not prefill_engine.has_unfinished_requests()
    # Had the fetch ended before the abort landed, a load into held blocks was under way: its
    # blocks come back at a step once its writes are over (never while a write may run).
    deadline = time.monotonic() + 30
    while prefill_engine.kv.pool.num_used and time.monotonic() < deadline:
        await disagg.prefill.engine.call(prefill_engine.step)
    assert prefill_engine.kv.pool.num_used == 0


async def test_a_prefill_during_which_the_bus_failed_runs_again(disagg: Disagg) -> None:
    """The first cancel check fails (Redis gone for a moment): the request is not acked
    unanswered but prefilled again, forwarded once and acked once."""
    port = disagg.prefill_port
    real = port.is_cancelled
    failures = [1]

    async def flaky(request_id: str) -> bool:
        if failures[0]:
            failures[0] -= 1
            raise ConnectionError("Connection closed by server.")
        return await real(request_id)

    port.is_cancelled = flaky  # type: ignore[method-assign]
    disagg.prefill.poll_s = 0.01  # the pause before running it again
    await disagg.prefill_bus.submit(GenerateRequest("flaky", prompt_of(2 * BLOCK + 3), SAMPLING))
    await port.acked("flaky")
    assert failures == [0] and port.acks == ["flaky"]
    assert [r.request_id for r in disagg.forwarded] == ["flaky"]
