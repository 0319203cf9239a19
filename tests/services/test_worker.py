"""EngineWorker on the in-process bus with the real engine: tokens out, cancels abort and free
blocks, bad requests become error events, and nothing imports torch on the gateway side."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kvserve.services.worker import EngineWorker, sampling_params_from_dict
from kvserve.shared.bus import InProcessBus
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.protocol import GenerateRequest, TokenEvent
from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams

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


def params(**kw: Any) -> dict[str, Any]:
    p = SamplingParams(**kw)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in p.__dict__.items()}


async def collect(stream: Any) -> list[TokenEvent]:
    return [ev async for ev in stream]


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.01)


async def test_worker_emits_the_engines_tokens(setup, engine, chat_prompt_ids) -> None:  # type: ignore[no-untyped-def]
    bus, _ = setup
    prompt = chat_prompt_ids[0]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = engine.generate([prompt], sp)  # before the worker's engine thread starts
    events = await collect(await bus.submit(GenerateRequest("a", prompt, params(**sp.__dict__))))
    assert [e.seq for e in events] == list(range(len(events)))
    assert [t for e in events for t in e.token_ids] == expected[0][0]
    assert events[-1].finish_reason == "length" and events[-1].num_prompt_tokens == len(prompt)
    # The same prompt again: its full blocks come from the prefix cache.
    again = await collect(await bus.submit(GenerateRequest("b", prompt, params(max_tokens=1))))
    assert again[0].num_cached_tokens == (len(prompt) - 1) // 16 * 16


async def test_cancel_aborts_and_frees_blocks(setup, chat_prompt_ids) -> None:  # type: ignore[no-untyped-def]
    bus, worker = setup
    long = params(max_tokens=500, ignore_eos=True)
    stream = await bus.submit(GenerateRequest("c", chat_prompt_ids[1], long))
    it = aiter(stream)
    first = await anext(it)
    assert first.token_ids and worker.engine.engine.pool.num_used > 0
    await bus.cancel("c")
    rest = [ev async for ev in it]
    assert rest[-1].error is not None and rest[-1].error.type == "cancelled"
    pool = worker.engine.engine.pool
    await until(lambda: worker.num_running == 0 and pool.num_used == 0)
    assert not worker.engine.engine.has_unfinished_requests()
    stats = (await bus.stats())["w"]
    assert stats["num_requests_running"] == 0 and stats["num_used_blocks"] == 0


@pytest.mark.parametrize(
    ("sampling", "prompt_len", "deadline", "etype", "param"),
    [
        ({"max_tokens": 0}, 4, None, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 4, "bogus": 1}, 4, None, "invalid_request_error", "bogus"),
        ({"max_tokens": NUM_BLOCKS * 16}, 4, None, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 4}, 4, 1.0, "timeout", None),
    ],
)
async def test_bad_requests_become_error_events(  # type: ignore[no-untyped-def]
    setup, sampling: dict[str, Any], prompt_len: int, deadline: float | None, etype: str, param
) -> None:
    bus, _ = setup
    req = GenerateRequest("bad", list(range(1, prompt_len + 1)), sampling, deadline=deadline)
    (ev,) = await collect(await bus.submit(req))
    assert ev.error is not None and ev.error.type == etype and ev.error.param == param


def test_sampling_params_from_dict_round_trip() -> None:
    p = SamplingParams(max_tokens=3, stop=("a", "b"), stop_token_ids=(5,), seed=2, n=2)
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in p.__dict__.items()}
    assert sampling_params_from_dict(d) == p
    with pytest.raises(InvalidRequestError):
        sampling_params_from_dict({"max_tokens": "x"})


def test_gateway_side_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "import kvserve.services.gateway.app, kvserve.shared.bus, kvserve.shared.protocol\n"
        "import kvserve.shared.telemetry, kvserve.services.serve\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
