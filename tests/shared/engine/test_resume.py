"""Exact-token resumption on the real default model: a request taken up with what the client
already received of it (Engine.add_request(resume=...)) continues the same generation, from
the next token, at any temperature; max_tokens and stop strings count the whole completion."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pytest
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.outputs import Emitted
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.engine.helpers import long_ids

MakeEngine = Callable[..., Engine]
HOT = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # every token of the vocabulary can come


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Stream:
    """One completion as a client receives it: per event, the tokens and the text."""

    tokens: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def all_tokens(self) -> list[int]:
        return [t for ev in self.tokens for t in ev]

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def upto(self, n_events: int) -> Emitted:
        """What the client had after `n_events` events."""
        toks = [t for ev in self.tokens[:n_events] for t in ev]
        return Emitted(toks, "".join(self.texts[:n_events]))


def run(
    engine: Engine,
    prompt: list[int],
    params: SamplingParams,
    resume: Mapping[int, Emitted] | None = None,
) -> dict[int, Stream]:
    engine.add_request("r", prompt, params, resume=resume)
    out: dict[int, Stream] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            for d in o.completions:
                s = out.setdefault(d.index, Stream())
                if d.token_ids or d.text:
                    s.tokens.append(d.token_ids)
                    s.texts.append(d.text)
                s.logprobs += d.logprobs
                s.finish_reason = d.finish_reason or s.finish_reason
    return out


@pytest.fixture(scope="module")
def prompt(tokenizer: KVTokenizer) -> list[int]:
    return long_ids(tokenizer, 5)[:40]


def test_a_sampled_request_resumed_anywhere_continues_the_same_generation(
    make_engine: MakeEngine, prompt: list[int], tokenizer: KVTokenizer
) -> None:
    engine = make_engine(num_blocks=64)
    params = SamplingParams(max_tokens=24, seed=7, ignore_eos=True, logprobs=True, **HOT)
    (full,) = run(engine, prompt, params).values()
    assert len(full.all_tokens) == 24
    for cut in (1, 9, 17, 23):
        got = full.upto(cut)
        (rest,) = run(engine, prompt, params, resume={0: got}).values()
        assert got.token_ids + rest.all_tokens == full.all_tokens, f"cut at {cut}"
        assert got.text + rest.text == full.text == tokenizer.decode(full.all_tokens)
        assert len(rest.logprobs) == 24 - cut  # max_tokens counts the whole completion
        assert rest.finish_reason == "length"
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_a_stop_string_across_the_resumption_point_is_found(
    make_engine: MakeEngine, prompt: list[int]
) -> None:
    engine = make_engine(num_blocks=64)
    (free,) = run(engine, prompt, SamplingParams(max_tokens=16, ignore_eos=True)).values()
    # A stop string that starts in event cut-1's text, ends in event cut's, and occurs
    # nowhere before.
    for cut in range(4, 14):
        before, after = free.texts[cut - 1], free.texts[cut]
        stop = before[-2:] + after
        head = "".join(free.texts[: cut - 1]) + before[:-2]
        if len(before) >= 2 and after and stop not in head + stop[:-1]:
            break
    else:
        pytest.fail("no cut where a stop string spans two events")
    params = SamplingParams(max_tokens=16, ignore_eos=True, stop=(stop,))
    (stopped,) = run(engine, prompt, params).values()
    assert stopped.text == head and stopped.finish_reason == "stop"
    # The first worker had sent `cut` tokens; it held back the text that could start `stop`.
    sent = Emitted(free.all_tokens[:cut], head)
    (rest,) = run(engine, prompt, params, resume={0: sent}).values()
    assert rest.finish_reason == "stop"
    assert head + rest.text == stopped.text
    assert sent.token_ids + rest.all_tokens == stopped.all_tokens


def test_n2_resumes_the_unfinished_completion_and_leaves_the_finished_one(
    make_engine: MakeEngine, prompt: list[int]
) -> None:
    engine = make_engine(num_blocks=64)
    params = SamplingParams(max_tokens=12, n=2, seed=3, ignore_eos=True, **HOT)
    full = run(engine, prompt, params)
    assert full[0].all_tokens != full[1].all_tokens
    done = Emitted(full[1].all_tokens, full[1].text, finished=True)
    resumed = run(engine, prompt, params, resume={0: full[0].upto(5), 1: done})
    assert full[0].upto(5).token_ids + resumed[0].all_tokens == full[0].all_tokens
    assert resumed[1].all_tokens == [] and resumed[1].text == ""
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_a_greedy_resumption_equals_the_uninterrupted_run(
    make_engine: MakeEngine, prompt: list[int]
) -> None:
    engine = make_engine(num_blocks=64)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    (full,) = run(engine, prompt, params).values()
    (rest,) = run(engine, prompt, params, resume={0: full.upto(13)}).values()
    assert full.upto(13).token_ids + rest.all_tokens == full.all_tokens
