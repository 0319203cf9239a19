"""Overlapped steps (`async_scheduling`): a step's outputs are made on the emitter thread while
the next step's model call runs. That must change no token, text, logprob or finish reason,
deliver every output once and in order, and keep a request that fails while it is emitted
from keeping the blocks the running step writes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from kvserve.shared.config import SpeculativeConfig
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.outputs import RequestOutput
from kvserve.shared.engine.request import Request
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.engine.helpers import SAMPLED, assert_no_leak, long_ids

MakeEngine = Callable[..., Engine]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Received:
    """What a client would have received of one request, output by output."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    error: str | None = None
    outputs_after_finish: int = 0
    finished: bool = False

    def take(self, out: RequestOutput) -> None:
        if self.finished:
            self.outputs_after_finish += 1
        if out.error is not None:
            self.error = str(out.error)
        for d in out.completions:
            self.tokens.setdefault(d.index, []).extend(d.token_ids)
            self.text[d.index] = self.text.get(d.index, "") + d.text
            self.logprobs.setdefault(d.index, []).extend(d.logprobs)
            self.finish[d.index] = d.finish_reason
        self.finished = self.finished or out.finished


Requests = list[tuple[str, list[int], SamplingParams]]


def run(engine: Engine, requests: Requests, late: Requests = ()) -> dict[str, Received]:  # type: ignore[assignment]
    """Every request added, `late` ones after the first step; stepped to the end."""
    got = {rid: Received() for rid, _, _ in [*requests, *late]}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    first = True
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].take(out)
        if first:
            for rid, prompt, params in late:
                engine.add_request(rid, prompt, params)
            first = False
    return got


@pytest.fixture(scope="module")
def mixed(tokenizer: KVTokenizer) -> Requests:
    """Greedy, seeded sampled with n = 2, top logprobs, a stop string, min_tokens, a beam
    search: every kind of output the step makes."""
    p = [long_ids(tokenizer, i)[: 20 + 7 * i] for i in range(6)]
    return [
        ("greedy", p[0], SamplingParams(max_tokens=14, ignore_eos=True)),
        ("n2", p[1], SamplingParams(max_tokens=10, n=2, seed=5, **SAMPLED)),  # type: ignore[arg-type]
        ("logprobs", p[2], SamplingParams(max_tokens=9, logprobs=True, top_logprobs=2)),
        ("stop", p[3], SamplingParams(max_tokens=30, stop=(" the", "."))),
        ("min", p[4], SamplingParams(max_tokens=12, min_tokens=6, seed=9, **SAMPLED)),  # type: ignore[arg-type]
        ("beam", p[5], SamplingParams(max_tokens=6, beam_width=2)),
    ]


def test_overlapped_steps_give_every_request_the_same_output(
    make_engine: MakeEngine, mixed: Requests
) -> None:
    sync = make_engine(async_scheduling=False)
    want = run(sync, mixed[:3], late=mixed[3:])
    assert_no_leak(sync)
    overlapped = make_engine()
    assert overlapped.overlap
    got = run(overlapped, mixed[:3], late=mixed[3:])
    assert_no_leak(overlapped)
    assert got == want
    assert overlapped.num_steps_ahead > 0  # steps of decodes alone ran their next call ahead
    assert want["stop"].finish == {0: "stop"}  # the stop string did end it
    assert all(r.finished and not r.outputs_after_finish for r in got.values())


def test_overlap_under_preemption_and_speculation(
    make_engine: MakeEngine, tokenizer: KVTokenizer
) -> None:
    """A cache too small for every request at once (preemption, recompute) and n-gram drafts."""
    prompts = [long_ids(tokenizer, i)[:40] * 2 for i in range(4)]  # repeats: drafts to find
    reqs = [
        (f"r{i}", p, SamplingParams(max_tokens=24, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    spec = SpeculativeConfig()
    results = []
    for overlap in (False, True):
        engine = make_engine(num_blocks=16, async_scheduling=overlap, speculative=spec)
        results.append(run(engine, reqs))
        assert engine.scheduler.num_preemptions > 0
        assert engine.spec_decode_stats["num_accepted_tokens"] > 0
        assert_no_leak(engine)
    assert results[1] == results[0]


def test_outputs_are_made_while_the_next_model_call_runs(
    make_engine: MakeEngine, mixed: Requests, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The emission of step N waits for step N+1's model call to begin, and the call waits
    for the emission to end: made one after the other on one thread, either would time out.
    (Steps that do not run ahead; those that do: test_a_step_of_decodes_runs_the_next_call...)"""
    engine = make_engine()
    monkeypatch.setattr(engine, "_spare_core", lambda: True)  # the emitter has a core
    monkeypatch.setattr(engine, "_may_run_ahead", lambda: False)
    running, emitted = threading.Event(), threading.Event()
    emit, model = engine.outputs.emit, engine.runner.run
    threads: list[str] = []

    def emit_during_the_call() -> list[RequestOutput]:
        threads.append(threading.current_thread().name)
        if threads[-1].startswith("kvserve-emit"):
            assert running.wait(10), "emitted before the model call began"
        out = emit()
        emitted.set()
        return out

    def call_awaiting_the_emission(batch, launched):  # type: ignore[no-untyped-def]
        def launch() -> None:
            pending = engine.outputs.has_unemitted
            launched()
            running.set()
            if pending:
                assert emitted.wait(10), "the model call began after the outputs were made"
            running.clear()
            emitted.clear()

        return model(batch, launch)

    monkeypatch.setattr(engine.outputs, "emit", emit_during_the_call)
    monkeypatch.setattr(engine.runner, "run", call_awaiting_the_emission)
    rid, prompt, params = mixed[0]
    got = run(engine, [(rid, prompt, params)])
    assert len(got[rid].tokens[0]) == params.max_tokens
    # every step's outputs during the next one's call; the last step's at once, with no call
    assert len(threads) == params.max_tokens
    assert all(t.startswith("kvserve-emit") for t in threads[:-1])
    assert threads[-1] == threading.current_thread().name


def test_the_emission_starts_as_the_layers_begin(
    make_engine: MakeEngine, mixed: Requests, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The emitter is handed its work after the embedding and the first norm, as the layers
    begin: it then finds the GIL free while their kernels run, instead of taking it from the
    embedding's small ops (every step, the C++ decode step's and the Python layers' alike); a
    run-ahead step that is one C++ call from the token ids on (LlamaModel.decode_tokens)
    hands it over just before that call."""
    from kvserve.kernels import cpu_decode_step

    engine = make_engine()
    model = engine.runner.model
    order: list[str] = []

    def noted(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            order.append(name)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(model, "embed_tokens", noted("embed", model.embed_tokens))
    first = model.layers[0]
    monkeypatch.setattr(first.input_norm, "forward", noted("norm", first.input_norm.forward))
    monkeypatch.setattr(first.attn, "forward", noted("layers", first.attn.forward))
    monkeypatch.setattr(model, "_decode_in_cpp", noted("layers", model._decode_in_cpp))
    whole = noted("whole", cpu_decode_step.decode_tokens)
    monkeypatch.setattr(cpu_decode_step, "decode_tokens", whole)
    run_model, run_ahead = engine.runner.run, engine.model_runner.run_ahead

    def run_noted(batch, launched):  # type: ignore[no-untyped-def]
        return run_model(batch, noted("launched", launched))

    def run_ahead_noted(batch, tokens, launched, argmax=False):  # type: ignore[no-untyped-def]
        return run_ahead(batch, tokens, noted("launched", launched), argmax)

    monkeypatch.setattr(engine.runner, "run", run_noted)
    monkeypatch.setattr(engine.runner, "run_ahead", run_ahead_noted)
    rid, prompt, params = mixed[0]
    got = run(engine, [(rid, prompt, params)])
    assert len(got[rid].tokens[0]) == params.max_tokens
    steps: list[list[str]] = [[]]
    for name in order:
        steps[-1].append(name)
        if name in ("layers", "whole"):
            steps.append([])
    assert steps.pop() == []
    assert len(steps) == params.max_tokens  # the prefill, then a decode step per token
    assert all(s in (["embed", "norm", "launched", "layers"], ["launched", "whole"]) for s in steps)
    assert steps.count(["launched", "whole"]) >= params.max_tokens // 2  # steps run ahead


def test_a_step_of_decodes_runs_the_next_call_before_its_outputs(
    make_engine: MakeEngine, mixed: Requests, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run ahead (vLLM's async scheduling): a step of plain decodes draws its tokens and runs
    the next model call with them; its outputs (tokens appended, stops, text) are made on the
    emitter while that call runs. Same outputs as without overlap; the stop string ends its
    request though the next call had already run for it (its row dropped)."""
    sync = make_engine(async_scheduling=False)
    want = run(sync, [mixed[0], mixed[3]])
    engine = make_engine()
    monkeypatch.setattr(engine, "_spare_core", lambda: True)  # the emitter has a core
    in_call, applying = threading.Event(), threading.Event()
    applied_in_call: list[tuple[str, bool]] = []
    apply, run_ahead = engine.outputs.apply, engine.model_runner.run_ahead

    def apply_noted(out, drawn):  # type: ignore[no-untyped-def]
        applied_in_call.append((threading.current_thread().name, in_call.is_set()))
        applying.set()
        return apply(out, drawn)

    def run_ahead_noted(batch, tokens, launched, argmax=False):  # type: ignore[no-untyped-def]
        def launch() -> None:  # the call goes on once the outputs are being made
            in_call.set()
            launched()
            assert applying.wait(10), "the step's outputs were not made during the next call"
            applying.clear()

        try:
            return run_ahead(batch, tokens, launch, argmax)
        finally:
            in_call.clear()

    monkeypatch.setattr(engine.outputs, "apply", apply_noted)
    monkeypatch.setattr(engine.runner, "run_ahead", run_ahead_noted)
    got = run(engine, [mixed[0], mixed[3]])
    assert got == want
    assert want["stop"].finish == {0: "stop"}
    assert engine.num_steps_ahead > 0 and len(applied_in_call) == engine.num_steps_ahead
    assert all(name.startswith("kvserve-emit") and during for name, during in applied_in_call)
    assert_no_leak(engine)


def test_a_run_ahead_call_of_greedy_rows_draws_their_tokens_itself(
    make_engine: MakeEngine, tokenizer: KVTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run-ahead step whose rows are all plain greedy (no top logprobs, nothing suppressed)
    takes the tokens its one C++ call drew (StepOutput.argmax): the sampler runs only for the
    steps that did not run ahead, or whose rows have min_tokens to keep; the same outputs as
    without overlap."""
    p = [long_ids(tokenizer, i)[: 30 + 5 * i] for i in range(3)]
    plain = [
        ("a", p[0], SamplingParams(max_tokens=12, ignore_eos=True)),
        ("b", p[1], SamplingParams(max_tokens=9, stop=(" the",))),
    ]
    held = ("min", p[2], SamplingParams(max_tokens=10, min_tokens=8))
    sync = make_engine(async_scheduling=False)
    want = run(sync, [*plain, held])
    engine = make_engine()
    if engine.runner.model.token_weights is None:
        pytest.skip("no C++ kernels on this machine")
    sampled = [0]
    draws: list[tuple[bool, int]] = []  # per draw: whether the call drew, the sampler's runs
    real_sample, draw = engine.outputs.sampler.sample, engine.outputs.draw

    def sample(*args):  # type: ignore[no-untyped-def]
        sampled[0] += 1
        return real_sample(*args)

    def noted_draw(out):  # type: ignore[no-untyped-def]
        before = sampled[0]
        drawn = draw(out)
        draws.append((out.argmax is not None, sampled[0] - before))
        return drawn

    monkeypatch.setattr(engine.outputs.sampler, "sample", sample)
    monkeypatch.setattr(engine.outputs, "draw", noted_draw)
    assert run(engine, plain) == {rid: want[rid] for rid, _, _ in plain}
    by_call = [n for drew, n in draws if drew]
    assert len(by_call) >= 5 and not any(by_call)  # the call's draws taken, the sampler idle
    draws.clear()
    assert run(engine, [held])["min"] == want["min"]
    by_call = [n for drew, n in draws if drew]
    assert by_call and all(by_call)  # EOS suppressed (min_tokens): the sampler drew
    assert_no_leak(engine)


def test_outputs_are_made_before_a_call_on_every_core(
    make_engine: MakeEngine, mixed: Requests, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step on every core leaves the emitter none: the outputs are made on the stepping
    thread as the call begins (a thread more would preempt one of the step's)."""
    engine = make_engine()
    assert not engine._spare_core()  # this module's steps compute on the one thread there is
    emit = engine.outputs.emit
    threads: set[str] = set()

    def recorded() -> list[RequestOutput]:
        threads.add(threading.current_thread().name)
        return emit()

    monkeypatch.setattr(engine.outputs, "emit", recorded)
    rid, prompt, params = mixed[0]
    got = run(engine, [(rid, prompt, params)])
    assert len(got[rid].tokens[0]) == params.max_tokens
    assert threads == {threading.current_thread().name}


def test_request_failing_while_emitted_fails_alone(
    make_engine: MakeEngine, mixed: Requests
) -> None:
    """Its row in the step that was running is dropped, its blocks freed; the others finish as
    they would have."""
    want = run(make_engine(async_scheduling=False), mixed[:2])
    engine = make_engine()
    output = engine.outputs._output
    outputs = {"n2": 0}

    def failing(req: Request) -> RequestOutput:
        if req.request_id == "n2":
            outputs["n2"] += 1
            if outputs["n2"] == 3:
                raise RuntimeError("output failed")
        return output(req)

    engine.outputs._output = failing  # type: ignore[method-assign]
    got = run(engine, mixed[:2])
    assert got["greedy"] == want["greedy"]
    assert got["n2"].error is not None and "output failed" in got["n2"].error
    assert got["n2"].tokens[0] == want["n2"].tokens[0][:2]  # two outputs reached the client
    assert engine.num_failed_requests == 1
    assert_no_leak(engine)


def test_abort_between_steps_drops_the_unemitted_output(
    make_engine: MakeEngine, mixed: Requests
) -> None:
    engine = make_engine()
    rid, prompt, params = mixed[0]
    engine.add_request(rid, prompt, params)
    engine.add_request("other", mixed[1][1], mixed[1][2])
    assert engine.step() == []  # the prefill's outputs wait for the next step
    assert engine.outputs.has_unemitted
    assert engine.abort_request(rid)
    outs = engine.step()
    assert [o.request_id for o in outs] == ["other"]
    while engine.has_unfinished_requests():
        assert all(o.request_id == "other" for o in engine.step())
    assert_no_leak(engine)
