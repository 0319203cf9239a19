"""Failure containment in the engine: a request whose own processing raises fails alone; a step
that fails as a whole requeues its requests, isolates them and quarantines the one to blame; too
many failed steps end the engine. The real engine and model throughout; failures are made by the
engine's fault injection or by patching one function."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from kvserve.shared.config import FaultConfig
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.failure import EngineDeadError, RequestFailedError
from kvserve.shared.engine.output_processor import OutputProcessor
from kvserve.shared.engine.outputs import RequestOutput
from kvserve.shared.engine.sampler import Sampler
from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def injecting(make_engine: Any, **faults: Any) -> Engine:
    engine: Engine = make_engine(faults=FaultConfig(injection=True, **faults))
    return engine


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    """Add every request, step until all have ended: per request its tokens (completion 0)
    or the exception it failed with."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, Any] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            collect(got, out)
    return got


def collect(got: dict[str, Any], out: RequestOutput) -> None:
    if out.error is not None:
        got[out.request_id] = out.error
        return
    for c in out.completions:
        if c.index == 0:
            got[out.request_id] += c.token_ids


def assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert not engine.scheduler.suspects and not engine.scheduler.failed_steps


@pytest.fixture(scope="module")
def calm(make_engine: Any, chat_prompt_ids: list[list[int]]) -> list[list[int]]:
    return [c[0] for c in make_engine().generate(chat_prompt_ids[:4], GREEDY)]


def test_fault_refused_unless_injection_is_on(make_engine: Any, chat_prompt_ids: Any) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", chat_prompt_ids[0], dataclasses.replace(GREEDY, fault="raise"))
    assert e.value.param == "fault"
    with pytest.raises(InvalidRequestError):
        SamplingParams(fault="explode")


@pytest.mark.parametrize("n", [1, 3])
def test_request_that_raises_fails_alone(
    make_engine: Any, chat_prompt_ids: list[list[int]], calm: list[list[int]], n: int
) -> None:
    engine = injecting(make_engine)
    good = {f"ok{i}": (p, GREEDY) for i, p in enumerate(chat_prompt_ids[:4])}
    bad = dataclasses.replace(GREEDY, fault="raise", n=n, temperature=0.8 if n > 1 else 0.0)
    got = run(engine, {**good, "bad": (chat_prompt_ids[4], bad)})
    assert [got[f"ok{i}"] for i in range(4)] == calm
    assert isinstance(got["bad"], RequestFailedError)
    assert got["bad"].kind == "internal_error" and "bad" in str(got["bad"])
    assert engine.num_failed_requests == 1 and engine.num_step_failures == 0
    assert_idle(engine)


def test_exception_in_stop_strings_is_pinned_on_its_request(
    make_engine: Any,
    chat_prompt_ids: list[list[int]],
    calm: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in one request's own processing (here its stop-string check, patched to raise
    for that request only) fails that request and no other."""
    original = OutputProcessor._stop_reason

    def stop_reason(self: OutputProcessor, seq: Any, comp: Any, token: int) -> Any:
        if seq.request_id == "bad":
            raise UnicodeError("a stop string that cannot be matched")
        return original(self, seq, comp, token)

    monkeypatch.setattr(OutputProcessor, "_stop_reason", stop_reason)
    engine = make_engine()
    good = {f"ok{i}": (p, GREEDY) for i, p in enumerate(chat_prompt_ids[:4])}
    got = run(engine, {**good, "bad": (chat_prompt_ids[4], GREEDY)})
    assert [got[f"ok{i}"] for i in range(4)] == calm
    assert isinstance(got["bad"], RequestFailedError)
    assert "UnicodeError" in str(got["bad"])
    assert_idle(engine)


def test_sampler_failure_of_one_row_spares_the_batch(
    make_engine: Any,
    chat_prompt_ids: list[list[int]],
    calm: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batched sampler raising (as a tiny top_p once made it) is retried request by
    request: only the request whose rows raise fails."""
    original = Sampler.sample

    def sample(self: Sampler, logits: Any, rows: Any) -> Any:
        if any(r.params.top_k == 7 for r in rows):
            raise RuntimeError("invalid multinomial distribution")
        return original(self, logits, rows)

    monkeypatch.setattr(Sampler, "sample", sample)
    engine = make_engine()
    bad = dataclasses.replace(GREEDY, temperature=1.0, top_k=7, seed=1)
    good = {f"ok{i}": (p, GREEDY) for i, p in enumerate(chat_prompt_ids[:4])}
    got = run(engine, {**good, "bad": (chat_prompt_ids[4], bad)})
    assert [got[f"ok{i}"] for i in range(4)] == calm
    assert isinstance(got["bad"], RequestFailedError)
    assert_idle(engine)


def test_failed_step_isolates_then_quarantines_the_culprit(
    make_engine: Any, chat_prompt_ids: list[list[int]], calm: list[list[int]]
) -> None:
    """A forward that fails whenever one request is in the batch: the first failure requeues
    all five; each runs alone next; the culprit's second failed step quarantines it; the
    others finish with the text they have without it."""
    engine = injecting(make_engine)
    good = {f"ok{i}": (p, GREEDY) for i, p in enumerate(chat_prompt_ids[:4])}
    bad = dataclasses.replace(GREEDY, fault="raise-step")
    got = run(engine, {**good, "bad": (chat_prompt_ids[4], bad)})
    assert [got[f"ok{i}"] for i in range(4)] == calm
    assert isinstance(got["bad"], RequestFailedError) and got["bad"].kind == "quarantined"
    assert engine.num_step_failures == 2  # the shared step, then the culprit's own
    assert engine.num_quarantined == 1 and engine.num_failed_requests == 0
    assert_idle(engine)


def test_transient_step_failure_is_retried(
    make_engine: Any,
    chat_prompt_ids: list[list[int]],
    calm: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One forward that fails once (mid-decode): every request is computed again and ends
    with the same tokens; nobody is quarantined."""
    engine = make_engine()
    runner = engine.model_runner
    original = runner.run
    calls = {"n": 0}

    def run_once_failing(batch: Any, launched: Any = None) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("a transient failure in the forward")
        return original(batch, launched)

    monkeypatch.setattr(runner, "run", run_once_failing)
    got = run(engine, {f"ok{i}": (p, GREEDY) for i, p in enumerate(chat_prompt_ids[:4])})
    assert [got[f"ok{i}"] for i in range(4)] == calm
    assert engine.num_step_failures == 1 and engine.num_quarantined == 0
    assert_idle(engine)


def test_repeated_step_failures_end_the_engine(
    make_engine: Any, chat_prompt_ids: list[list[int]]
) -> None:
    engine = injecting(make_engine, max_step_failures=3, quarantine_after=5)
    bad = dataclasses.replace(GREEDY, fault="raise-step")
    for i in range(3):
        engine.add_request(f"bad{i}", chat_prompt_ids[i], bad)
    with pytest.raises(EngineDeadError):
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.num_step_failures == 3


async def test_async_engine_survives_a_failing_request(
    make_engine: Any, chat_prompt_ids: list[list[int]], calm: list[list[int]]
) -> None:
    """Through the AsyncEngine: the failing request's consumer gets the error, the others
    their full outputs, the engine thread lives on and serves the next request."""
    engine = AsyncEngine(injecting(make_engine))

    async def consume(rid: str, prompt: list[int], params: SamplingParams) -> Any:
        tokens: list[int] = []
        try:
            async for out in engine.generate(rid, prompt, params):
                tokens += out.completions[0].token_ids
        except RequestFailedError as e:
            return e
        return tokens

    try:
        bad = dataclasses.replace(GREEDY, fault="raise")
        results = await asyncio.gather(
            *(consume(f"ok{i}", p, GREEDY) for i, p in enumerate(chat_prompt_ids[:4])),
            consume("bad", chat_prompt_ids[4], bad),
        )
        assert results[:4] == calm
        assert isinstance(results[4], RequestFailedError)
        assert engine.healthy
        assert await consume("after", chat_prompt_ids[0], GREEDY) == calm[0]
        stats = engine.stats()
        assert stats["num_requests_failed"] == 1 and stats["num_used_blocks"] == 0
    finally:
        engine.stop()
