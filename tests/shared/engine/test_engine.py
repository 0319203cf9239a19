"""The Engine on the real default model (SmolLM2-135M, fp32, CPU).

Batched, chunked and preempted runs must give each request the tokens it gets alone; blocks
never leak; sampling settings do what they say; bad requests are refused by field name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.scheduler import Batch
from kvserve.shared.engine.sequence import Sequence
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams

from tests.shared.engine.helpers import SAMPLED, assert_no_leak, long_ids

MakeEngine = Callable[..., Engine]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


LENGTHS = [10, 118, 23, 64, 37, 91, 15, 120, 48, 77, 12, 105, 30, 56, 84, 19]
MAX_TOKENS = [8, 24, 9, 12, 10, 16, 8, 9, 11, 12, 20, 8, 10, 9, 14, 11]


@pytest.fixture(scope="module")
def prompts(tokenizer: KVTokenizer) -> list[list[int]]:
    out = [long_ids(tokenizer, i)[:n] for i, n in enumerate(LENGTHS)]
    assert [len(p) for p in out] == LENGTHS
    return out


@pytest.fixture(scope="module")
def prompt(tokenizer: KVTokenizer) -> list[int]:
    """21 tokens: one full block of 16 and a partial one."""
    return long_ids(tokenizer, 3)[:21]


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def run(
    engine: Engine,
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
    on_step: Callable[[], object] | None = None,
) -> dict[str, list[Completion]]:
    """Add requests at the given step numbers and step until all are done; accumulate deltas."""
    results: dict[str, dict[int, Completion]] = {}
    t = 0
    last_arrival = max(arrivals, default=0)
    while t <= last_arrival or engine.has_unfinished_requests():
        for rid, ids, params in arrivals.get(t, []):
            engine.add_request(rid, ids, params)
            results[rid] = {}
        for out in engine.step():
            for d in out.completions:
                c = results[out.request_id].setdefault(d.index, Completion())
                c.tokens += d.token_ids
                c.text += d.text
                c.logprobs += d.logprobs
                if d.finish_reason is not None:
                    c.finish_reason = d.finish_reason
            if out.finished:
                assert all(d.finish_reason is not None for d in out.completions)
        if on_step is not None:
            on_step()
        t += 1
        assert t < 2000, "engine did not finish"
    return {rid: [cs[i] for i in sorted(cs)] for rid, cs in results.items()}


def run_one(engine: Engine, ids: list[int], params: SamplingParams) -> list[Completion]:
    return run(engine, {0: [("one", ids, params)]})["one"]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def seqs_of(engine: Engine, rid: str) -> list[Sequence]:
    s = engine.scheduler
    return [q for q in [*s.running, *s.waiting] if q.request_id == rid]


def record_batches(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[Batch]:
    batches: list[Batch] = []
    schedule = engine.scheduler.schedule

    def wrapped() -> Batch:
        batch = schedule()
        batches.append(batch)
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", wrapped)
    return batches


# ---- batch independence ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def alone(make_engine: MakeEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Each request's greedy tokens, run alone (one after another) without chunking."""
    engine = make_engine(num_blocks=16)
    out = []
    for ids, m in zip(prompts, MAX_TOKENS, strict=True):
        (c,) = run_one(engine, ids, greedy(m))
        assert len(c.tokens) == m and c.finish_reason == "length"
        out.append(c.tokens)
    assert_no_leak(engine)
    return out


def staggered(prompts: list[list[int]]) -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Two new requests every step."""
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for i, (ids, m) in enumerate(zip(prompts, MAX_TOKENS, strict=True)):
        arrivals.setdefault(i // 2, []).append((f"r{i}", ids, greedy(m)))
    return arrivals


def test_batched_chunked_equals_alone(
    make_engine: MakeEngine, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    engine = make_engine(num_blocks=160, max_num_batched_tokens=64, max_prefill_chunk=32)
    results = run(engine, staggered(prompts))
    got = [results[f"r{i}"][0].tokens for i in range(len(prompts))]
    assert got == alone
    assert all(results[f"r{i}"][0].finish_reason == "length" for i in range(len(prompts)))
    assert engine.scheduler.num_preemptions == 0
    assert_no_leak(engine)


def test_batched_with_preemption_equals_alone(
    make_engine: MakeEngine, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    engine = make_engine(num_blocks=32, max_num_batched_tokens=64, max_prefill_chunk=32)
    results = run(engine, staggered(prompts), on_step=engine.kv.pool.check)
    got = [results[f"r{i}"][0].tokens for i in range(len(prompts))]
    assert engine.scheduler.num_preemptions > 0
    assert got == alone
    assert_no_leak(engine)


# ---- no leak --------------------------------------------------------------------------------


def test_abort_frees_blocks_at_once(make_engine: MakeEngine, prompts: list[list[int]]) -> None:
    engine = make_engine(num_blocks=64, max_num_batched_tokens=64, max_prefill_chunk=32)
    engine.add_request("decoding", prompts[0], greedy(20))
    engine.add_request("prefilling", prompts[1], greedy(20))
    engine.add_request("other", prompts[2], greedy(6))
    for _ in range(2):
        engine.step()
    (dec,) = seqs_of(engine, "decoding")
    (pre,) = seqs_of(engine, "prefilling")
    assert dec.num_output_tokens > 0
    assert 0 < pre.num_computed_tokens < pre.num_prompt_tokens

    for seq in (pre, dec):
        free, held = engine.kv.pool.num_free, len(seq.block_table)
        assert held > 0
        assert engine.abort_request(seq.request_id) is True
        assert engine.kv.pool.num_free == free + held
        assert seq.block_table == [] and seq.is_finished
        assert seq.finish_reason is not None and seq.finish_reason.value == "abort"
        engine.kv.pool.check()
    assert engine.abort_request("decoding") is False
    assert engine.abort_request("never-added") is False

    # Not yet admitted: nothing to free, and it is gone from the queue.
    engine.add_request("queued", prompts[3], greedy(4))
    free = engine.kv.pool.num_free
    assert engine.abort_request("queued") is True
    assert engine.kv.pool.num_free == free
    assert not seqs_of(engine, "queued")

    # n > 1 after the fork: siblings share the prompt's blocks; aborting frees them all.
    engine.add_request("forked", prompts[4], SamplingParams(max_tokens=20, n=3, seed=1, **SAMPLED))
    while len(seqs_of(engine, "forked")) < 3:
        engine.step()
    assert engine.kv.pool.is_shared(seqs_of(engine, "forked")[0].block_table[0])
    assert engine.abort_request("forked") is True

    seen: set[str] = set()
    while engine.has_unfinished_requests():
        seen |= {o.request_id for o in engine.step()}
    assert seen == {"other"}
    assert_no_leak(engine)


def test_no_leak_after_mixed_requests_finish(
    make_engine: MakeEngine, prompts: list[list[int]]
) -> None:
    engine = make_engine(num_blocks=32, max_num_batched_tokens=48, max_prefill_chunk=16)
    arrivals = {
        0: [
            ("a", prompts[0], greedy(5)),
            (
                "b",
                prompts[3],
                SamplingParams(max_tokens=6, n=2, seed=3, ignore_eos=True, **SAMPLED),
            ),
        ],
        1: [("c", prompts[5], greedy(3, stop_token_ids=(13,)))],
        2: [("d", prompts[6], SamplingParams(max_tokens=4, seed=9, logprobs=True, **SAMPLED))],
    }
    results = run(engine, arrivals, on_step=engine.kv.pool.check)
    assert [len(c.tokens) for c in results["a"]] == [5]
    assert [len(c.tokens) for c in results["b"]] == [6, 6]
    assert len(results["d"][0].logprobs) == len(results["d"][0].tokens)
    assert_no_leak(engine)


# ---- sampling -------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(
    make_engine: MakeEngine, prompt: list[int], prompts: list[list[int]]
) -> None:
    engine = make_engine(num_blocks=32)
    params = SamplingParams(max_tokens=8, seed=1234, ignore_eos=True, **SAMPLED)
    (first,) = run_one(engine, prompt, params)
    (again,) = run_one(engine, prompt, params)
    assert len(first.tokens) == 8
    assert again.tokens == first.tokens
    (other,) = run_one(
        engine, prompt, SamplingParams(max_tokens=8, seed=4321, ignore_eos=True, **SAMPLED)
    )
    assert other.tokens != first.tokens
    # The same seed batched with another sampled request, which has no seed.
    res = run(
        engine,
        {
            0: [("seeded", prompt, params)],
            1: [("noise", prompts[2], SamplingParams(max_tokens=8, ignore_eos=True, **SAMPLED))],
        },
    )
    assert res["seeded"][0].tokens == first.tokens
    assert_no_leak(engine)


def test_max_tokens_gives_exactly_that_many(make_engine: MakeEngine, prompt: list[int]) -> None:
    engine = make_engine(num_blocks=32)
    (one,) = run_one(engine, prompt, greedy(1))
    (five,) = run_one(engine, prompt, greedy(5))
    assert (len(one.tokens), one.finish_reason) == (1, "length")
    assert (len(five.tokens), five.finish_reason) == (5, "length")
    assert five.tokens[:1] == one.tokens
    assert_no_leak(engine)


def test_stop_token_ids_stop_generation(make_engine: MakeEngine, prompt: list[int]) -> None:
    engine = make_engine(num_blocks=32)
    (full,) = run_one(engine, prompt, greedy(16))
    k = next(i for i in range(2, 16) if full.tokens[i] not in full.tokens[:i])
    stop = full.tokens[k]
    (c,) = run_one(engine, prompt, greedy(16, stop_token_ids=(stop,)))
    assert c.tokens == full.tokens[: k + 1]
    assert c.finish_reason == "stop"
    assert_no_leak(engine)


def test_min_tokens_holds_back_stop_tokens_and_strings(
    make_engine: MakeEngine, prompt: list[int]
) -> None:
    """Before `min_tokens` outputs no stop token can be drawn (the next most likely is) and no
    stop string ends the output; from then on they stop it as usual."""
    engine = make_engine(num_blocks=32)
    (full,) = run_one(engine, prompt, greedy(8))
    first = full.tokens[0]
    (stopped,) = run_one(engine, prompt, greedy(8, stop_token_ids=(first,)))
    assert (stopped.tokens, stopped.finish_reason) == ([first], "stop")
    (held,) = run_one(engine, prompt, greedy(8, stop_token_ids=(first,), min_tokens=3))
    assert first not in held.tokens[:3] and len(held.tokens) >= 3
    assert held.finish_reason == "stop" or len(held.tokens) == 8
    # The hold changed what was drawn: the first token is not greedy's.
    assert held.tokens[0] != full.tokens[0]
    text = engine.tokenizer.decode(full.tokens[:1])
    (by_string,) = run_one(engine, prompt, greedy(8, stop=(text,), min_tokens=2))
    assert len(by_string.tokens) >= 2
    assert_no_leak(engine)


@pytest.mark.parametrize(
    ("kw", "param"),
    [({"min_tokens": 9}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
     ({"min_tokens": 2, "beam_width": 2}, "min_tokens")],
)  # fmt: skip
def test_min_tokens_bounds(kw: dict[str, int], param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=8, **kw)
    assert e.value.param == param


def test_stop_string_truncates_the_text(make_engine: MakeEngine, prompt: list[int]) -> None:
    engine = make_engine(num_blocks=32)
    (full,) = run_one(engine, prompt, greedy(24))
    assert full.text == engine.tokenizer.decode(full.tokens)
    mid = len(full.text) // 2
    stop = full.text[mid : mid + 5]
    at = full.text.find(stop)
    assert at > 0 and at + len(stop) < len(full.text)
    (c,) = run_one(engine, prompt, greedy(24, stop=(stop,)))
    assert c.finish_reason == "stop"
    assert c.text == full.text[:at]
    assert c.tokens == full.tokens[: len(c.tokens)]
    assert len(c.tokens) < 24
    assert stop in engine.tokenizer.decode(c.tokens)
    assert stop not in engine.tokenizer.decode(c.tokens[:-1])
    assert_no_leak(engine)


def test_greedy_logprobs_are_the_max_of_the_scored_distribution(
    make_engine: MakeEngine, prompt: list[int]
) -> None:
    engine = make_engine(num_blocks=32)
    (c,) = run_one(engine, prompt, greedy(6, logprobs=True))
    assert len(c.logprobs) == len(c.tokens) == 6
    assert all(lp <= 0 for lp in c.logprobs)
    for i, (tok, lp) in enumerate(zip(c.tokens, c.logprobs, strict=True)):
        dist = torch.log_softmax(engine.score(prompt + c.tokens[:i])[-1], dim=-1)
        assert int(dist.argmax()) == tok
        assert lp == pytest.approx(float(dist.max()), abs=1e-4)
    (plain,) = run_one(engine, prompt, greedy(6))
    assert plain.logprobs == [] and plain.tokens == c.tokens
    assert_no_leak(engine)


def test_sampled_logprobs_are_of_the_chosen_token(
    make_engine: MakeEngine, prompt: list[int]
) -> None:
    engine = make_engine(num_blocks=32)
    params = SamplingParams(max_tokens=5, seed=5, logprobs=True, ignore_eos=True, **SAMPLED)
    (c,) = run_one(engine, prompt, params)
    assert len(c.logprobs) == 5
    for i, (tok, lp) in enumerate(zip(c.tokens, c.logprobs, strict=True)):
        dist = torch.log_softmax(engine.score(prompt + c.tokens[:i])[-1], dim=-1)
        assert lp <= 0
        assert lp == pytest.approx(float(dist[tok]), abs=1e-4)


def test_n3_shares_the_prompt_and_copies_the_partial_block(
    make_engine: MakeEngine, prompt: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(num_blocks=32, async_scheduling=False)  # a step's own outputs
    base = {"max_tokens": 8, "seed": 11, "ignore_eos": True, **SAMPLED}
    (single,) = run_one(engine, prompt, SamplingParams(**base))
    assert_no_leak(engine)

    batches = record_batches(engine, monkeypatch)
    engine.add_request("n3", prompt, SamplingParams(n=3, **base))
    outs = engine.step()  # the whole prompt in one step, then the fork
    assert len(batches) == 1
    sibs = sorted(seqs_of(engine, "n3"), key=lambda s: s.index)
    assert [s.index for s in sibs] == [0, 1, 2]
    assert len(prompt) == 21
    tables = [s.block_table for s in sibs]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 2
    assert [engine.kv.pool.ref_counts[b] for b in tables[0]] == [3, 3]
    assert engine.kv.pool.num_used == 2
    assert [len(d.token_ids) for d in outs[0].completions] == [1, 1, 1]
    full, partial = tables[0]

    outs += engine.step()
    # The first two writers of the shared partial block get copies; the last writes in place.
    assert len(batches[1].block_copies) == 2
    assert [src for src, _ in batches[1].block_copies] == [partial, partial]
    tables = [s.block_table for s in sibs]
    assert [t[0] for t in tables] == [full, full, full]
    assert len({t[1] for t in tables}) == 3
    assert engine.kv.pool.ref_counts[full] == 3
    assert all(engine.kv.pool.ref_counts[t[1]] == 1 for t in tables)

    while engine.has_unfinished_requests():
        outs += engine.step()
    comps: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for o in outs:
        for d in o.completions:
            comps[d.index] += d.token_ids
    assert [len(comps[i]) for i in range(3)] == [8, 8, 8]
    assert comps[0] == single.tokens
    assert comps[1] != comps[0] or comps[2] != comps[0]
    assert_no_leak(engine)


def test_n2_sibling_survives_its_parent_stopping_on_the_first_token(
    make_engine: MakeEngine, prompt: list[int]
) -> None:
    """The parent (index 0) stops on its first token while its sibling goes on: the sibling
    must still hold the prompt's blocks and generate what it generates when nobody stops."""
    engine = make_engine(num_blocks=32)
    for seed in range(20):
        params = SamplingParams(max_tokens=6, n=2, seed=seed, ignore_eos=True, **SAMPLED)
        free_run = run_one(engine, prompt, params)
        first = free_run[0].tokens[0]
        if first not in free_run[1].tokens:
            break
    else:
        pytest.fail("no seed where the sibling never samples the parent's first token")
    stop_first = SamplingParams(
        max_tokens=6, n=2, seed=seed, ignore_eos=True, stop_token_ids=(first,), **SAMPLED
    )
    engine.add_request("stopped", prompt, stop_first)
    engine.step()
    (sibling,) = seqs_of(engine, "stopped")
    assert sibling.index == 1
    assert sibling.num_computed_tokens == len(prompt)
    assert len(sibling.block_table) == 2, "the sibling lost the prompt's blocks"
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(engine)
    stopped = run_one(engine, prompt, stop_first)
    assert stopped[0].tokens == [first] and stopped[0].finish_reason == "stop"
    assert stopped[1].tokens == free_run[1].tokens
    assert stopped[1].finish_reason == "length"


def test_eos_stops_unless_ignored(
    make_engine: MakeEngine, chat_prompt_ids: list[list[int]]
) -> None:
    engine = make_engine(num_blocks=32)
    ids = chat_prompt_ids[0]  # "What is the capital of France?"
    (c,) = run_one(engine, ids, SamplingParams(max_tokens=16))
    assert c.finish_reason == "stop"
    assert c.tokens[-1] in engine.eos_token_ids
    assert not any(t in engine.eos_token_ids for t in c.tokens[:-1])
    assert c.text == engine.tokenizer.decode(c.tokens)
    assert "Paris" in c.text
    n = len(c.tokens)
    (more,) = run_one(engine, ids, SamplingParams(max_tokens=n + 2, ignore_eos=True))
    assert more.tokens[:n] == c.tokens
    assert len(more.tokens) == n + 2 and more.finish_reason == "length"
    assert_no_leak(engine)


# ---- bad input ------------------------------------------------------------------------------


def test_bad_requests_are_refused_by_field_and_the_engine_keeps_serving(
    make_engine: MakeEngine, prompt: list[int]
) -> None:
    engine = make_engine(num_blocks=8)
    max_len = engine.max_model_len
    vocab = engine.model_config.vocab_size

    def add(ids: list[int], **kw: object) -> Callable[[], object]:
        return lambda: engine.add_request("bad", ids, SamplingParams(**kw))

    cases: list[tuple[str, str, Callable[[], object]]] = [
        ("prompt", "empty", add([], max_tokens=4)),
        ("prompt", "token ids", add([vocab], max_tokens=4)),
        ("prompt", "token ids", add([-1, 5], max_tokens=4)),
        ("max_tokens", "context window", add([1] * (max_len - 2), max_tokens=3)),
        # Fits the context but not the 8 * 16 tokens of this engine's KV cache.
        ("max_tokens", "KV cache", add(prompt, max_tokens=8 * 16 - 20)),
        ("max_tokens", ">= 1", add(prompt, max_tokens=0)),
        ("top_p", "(0, 1]", add(prompt, top_p=0)),
        ("top_p", "(0, 1]", add(prompt, top_p=1.5)),
        ("temperature", ">= 0", add(prompt, temperature=-1)),
        ("n", ">= 1", add(prompt, n=0)),
        ("top_k", ">= 0", add(prompt, top_k=-1)),
        ("stop", "non-empty", add(prompt, stop=("",))),
    ]
    for param, words, call in cases:
        with pytest.raises(InvalidRequestError) as err:
            call()
        assert (err.value.param, words in str(err.value)) == (param, True), str(err.value)
        assert engine.num_requests == 0
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks

    # Exactly at the limits is fine: prompt + max_tokens == 8 * 16 tokens of cache.
    engine.validate(prompt, greedy(8 * 16 - 21))

    (c,) = run_one(engine, prompt, greedy(4))
    assert len(c.tokens) == 4 and c.finish_reason == "length"
    engine.add_request("dup", prompt, greedy(2))
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("dup", prompt, greedy(2))
    assert err.value.param == "request_id"
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(engine)
