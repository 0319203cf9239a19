"""EngineWorker on the in-process bus with the real engine: tokens out, cancels abort and free
blocks, bad requests become error events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kvserve.services.workers.engine_worker import EngineWorker
from kvserve.shared.bus.memory import InProcessBus
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.protocol import GenerateRequest, TokenEvent
from kvserve.shared.sampling_params import SamplingParams

from tests.polling import until

NUM_BLOCKS = 64


@pytest.fixture
def engine(services_engine: Any) -> Any:
    return services_engine


@pytest.fixture
async def setup(engine: Any) -> AsyncIterator[tuple[InProcessBus, EngineWorker]]:
    """A worker on a fresh bus over the module's engine (its thread starts with the first
    request and stops at the end, so the engine can be used directly between tests)."""
    bus = InProcessBus()
    worker = EngineWorker(bus.worker("w"), AsyncEngine(engine), poll_s=0.05)
    await worker.start()
    try:
        yield bus, worker
    finally:
        await worker.stop(drain_timeout=0)
        worker.engine.stop()


async def collect(stream: Any) -> list[TokenEvent]:
    return [ev async for ev in stream]


async def test_worker_emits_the_engines_tokens(setup, engine, chat_prompt_ids) -> None:  # type: ignore[no-untyped-def]
    bus, _ = setup
    prompt = chat_prompt_ids[0]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = engine.generate([prompt], sp)  # before the worker's engine thread starts
    events = await collect(await bus.submit(GenerateRequest("a", prompt, sp)))
    assert [e.seq for e in events] == list(range(len(events)))
    assert [t for e in events for t in e.token_ids] == expected[0][0]
    assert events[-1].finish_reason == "length" and events[-1].num_prompt_tokens == len(prompt)
    # The same prompt again: its full blocks come from the prefix cache.
    one = SamplingParams(max_tokens=1)
    again = await collect(await bus.submit(GenerateRequest("b", prompt, one)))
    assert again[0].num_cached_tokens == (len(prompt) - 1) // 16 * 16
    # all from the device cache; the engine has no store to ask
    by_tier = {"device": again[0].num_cached_tokens, "host": 0, "store": 0}
    assert (again[0].cached_tokens_by_source, again[0].store_lookup) == (by_tier, None)


async def test_cancel_aborts_and_frees_blocks(setup, chat_prompt_ids) -> None:  # type: ignore[no-untyped-def]
    bus, worker = setup
    long = SamplingParams(max_tokens=500, ignore_eos=True)
    stream = await bus.submit(GenerateRequest("c", chat_prompt_ids[1], long))
    it = aiter(stream)
    first = await anext(it)
    assert first.token_ids and worker.engine.engine.kv.pool.num_used > 0
    await bus.cancel("c")
    rest = [ev async for ev in it]
    assert rest[-1].error is not None and rest[-1].error.type == "cancelled"
    pool = worker.engine.engine.kv.pool
    await until(lambda: worker.num_running == 0 and pool.num_used == 0)
    assert not worker.engine.engine.has_unfinished_requests()
    stats = (await bus.stats())["w"]
    assert stats["num_requests_running"] == 0 and stats["num_used_blocks"] == 0


@pytest.mark.parametrize(
    ("max_tokens", "deadline", "etype", "param"),
    [
        (NUM_BLOCKS * 16, None, "invalid_request_error", "max_tokens"),  # beyond the KV cache
        (4, 1.0, "timeout", None),
    ],
)
async def test_bad_requests_become_error_events(  # type: ignore[no-untyped-def]
    setup, max_tokens: int, deadline: float | None, etype: str, param
) -> None:
    """(Malformed sampling parameters never reach a worker: the bus refuses them,
    tests/shared/test_protocol.py.)"""
    bus, _ = setup
    sampling = SamplingParams(max_tokens=max_tokens)
    req = GenerateRequest("bad", [1, 2, 3, 4], sampling, deadline=deadline)
    (ev,) = await collect(await bus.submit(req))
    assert ev.error is not None and ev.error.type == etype and ev.error.param == param


async def test_a_request_during_which_the_bus_failed_runs_again(  # type: ignore[no-untyped-def]
    engine, chat_prompt_ids
) -> None:
    """The first cancel check and the first emit fail (Redis gone for a moment): the request is
    not acked and lost but runs again, and the client gets its whole answer once."""
    from tests.services.workers.disagg import AckRecordingPort

    bus = InProcessBus()
    port = AckRecordingPort(bus.worker("w"))
    failures = {"is_cancelled": 1, "emit": 1}

    def flaky(name: str, call: Any) -> Any:
        async def wrapped(*args: Any) -> Any:
            if failures[name]:
                failures[name] -= 1
                raise ConnectionError("Connection closed by server.")
            return await call(*args)

        return wrapped

    port.is_cancelled = flaky("is_cancelled", port.is_cancelled)  # type: ignore[method-assign]
    port.emit = flaky("emit", port.emit)  # type: ignore[method-assign]
    worker = EngineWorker(port, AsyncEngine(engine), poll_s=0.01)
    await worker.start()
    try:
        sp = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
        events = await collect(await bus.submit(GenerateRequest("a", chat_prompt_ids[1], sp)))
        await port.acked("a")
    finally:
        await worker.stop(drain_timeout=0)
        worker.engine.stop()
    assert failures == {"is_cancelled": 0, "emit": 0}
    assert [e.seq for e in events] == list(range(len(events))) and events[-1].finish_reason
    assert len([t for e in events for t in e.token_ids]) == 4 and port.acks == ["a"]


async def test_a_request_that_raises_fails_alone(  # type: ignore[no-untyped-def]
    setup, engine, chat_prompt_ids, monkeypatch
) -> None:
    """An exception in one request's own processing (its stop-string check, patched to raise
    for it alone) ends that request with a server_error event naming it; the request running
    beside it in the same steps gets its whole answer, and the worker serves the next one."""
    from kvserve.shared.engine.output_processor import OutputProcessor

    bus, worker = setup
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = engine.generate([chat_prompt_ids[2]], sp)[0][0]
    original = OutputProcessor._stop_reason

    def stop_reason(self: Any, seq: Any, comp: Any, token: int) -> Any:
        if seq.request_id == "bad" and seq.num_output_tokens == 3:
            raise RuntimeError("a bug in this request's stop check")
        return original(self, seq, comp, token)

    monkeypatch.setattr(OutputProcessor, "_stop_reason", stop_reason)
    bad, good = await asyncio.gather(
        collect(await bus.submit(GenerateRequest("bad", chat_prompt_ids[1], sp))),
        collect(await bus.submit(GenerateRequest("good", chat_prompt_ids[2], sp))),
    )
    err = bad[-1].error
    assert err is not None and err.type == "server_error" and err.code == "internal_error"
    assert "bad" in err.message and "RuntimeError" in err.message
    assert [t for e in good for t in e.token_ids] == expected
    assert worker.engine.healthy and not worker.engine_failed.is_set()
    again = await collect(await bus.submit(GenerateRequest("again", chat_prompt_ids[2], sp)))
    assert [t for e in again for t in e.token_ids] == expected
    pool = worker.engine.engine.kv.pool
    await until(lambda: worker.num_running == 0 and pool.num_used == 0)
    assert worker.stats()["num_requests_failed"] == 1


async def test_a_delivery_taken_over_stops_and_frees_blocks(setup, chat_prompt_ids) -> None:  # type: ignore[no-untyped-def]
    """The port says another worker took the delivery over (as the Redis port's heartbeat
    finds, tests/shared/bus/test_fencing.py): the request stops here and its blocks free."""
    bus, worker = setup
    long = SamplingParams(max_tokens=500, ignore_eos=True)
    stream = await bus.submit(GenerateRequest("t", chat_prompt_ids[1], long))
    it = aiter(stream)
    assert (await anext(it)).token_ids
    running = worker._running["t"]
    assert worker.port.on_taken_over is not None
    worker.port.on_taken_over(running.delivery)
    pool = worker.engine.engine.kv.pool
    await until(lambda: worker.num_running == 0 and pool.num_used == 0)
    assert running.task.done()
    await stream.close()


async def test_a_dead_engine_ends_the_worker(make_engine, chat_prompt_ids) -> None:  # type: ignore[no-untyped-def]
    """Failed steps past the engine's bound kill its thread: the request gets an error, the
    worker leaves the bus and sets `engine_failed` (its process then exits non-zero)."""
    from kvserve.shared.config import FaultConfig

    faults = FaultConfig(injection=True, max_step_failures=1)
    bus = InProcessBus()
    worker = EngineWorker(bus.worker("w"), AsyncEngine(make_engine(faults=faults)), poll_s=0.05)
    await worker.start()
    try:
        sp = SamplingParams(max_tokens=4, fault="raise-step")
        (ev,) = await collect(await bus.submit(GenerateRequest("x", chat_prompt_ids[0], sp)))
        assert ev.error is not None and ev.error.type == "server_error"
        await asyncio.wait_for(worker.engine_failed.wait(), 10)
        assert not worker.engine.healthy and not await bus.ready()
    finally:
        await worker.stop(drain_timeout=0)
        worker.engine.stop()
