"""Speculative decoding by n-gram lookup on the real default model: the output is the one a run
without drafts gives (greedy token for token, a seeded sampled request too), on held-out
prompts, with prefix caching, under preemption, with max_tokens and stop strings inside an
accepted run, rejections, logprobs, min_tokens, a resumption and a disaggregated hand-off; the
blocks it publishes are the plain run's (no rejected draft in one); n > 1 and beam search never
draft; drafted decodes run on the C++ decode step as a chunk would compute them; the counters
reach the engine's stats and Prometheus."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kvserve.shared.config import SpeculativeConfig, StoreConfig
from kvserve.shared.engine.async_engine import AsyncEngine
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.outputs import Emitted
from kvserve.shared.engine.scheduler import Batch, ScheduledSeq
from kvserve.shared.engine.sequence import SeqId, Sequence
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.telemetry import EngineStatsCollector
from prometheus_client import CollectorRegistry, generate_latest

from tests.shared.engine.helpers import TEXTS, run_one

MakeEngine = Callable[..., Engine]
SPEC = SpeculativeConfig(num_speculative_tokens=4)
GREEDY = SamplingParams(max_tokens=40)
CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)
CHATS = [
    "Rewrite this paragraph exactly, word for word: " + TEXTS[4] + " " + TEXTS[7],
    "Copy this Python code exactly:\n" + CODE,
    "Name three rivers in Europe.",
    "Why is the sky blue? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def chats(tokenizer: KVTokenizer) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]


@pytest.fixture(scope="module")
def plain(make_engine: MakeEngine) -> Engine:
    """An engine without speculation (prefix caching off): the reference."""
    return make_engine(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference(plain: Engine, chats: list[list[int]]) -> list[list[int]]:
    """Each chat's greedy output without drafts, alone."""
    return [plain.generate([c], GREEDY)[0][0] for c in chats]


def speculative(make_engine: MakeEngine, **kw: Any) -> Engine:
    return make_engine(speculative=SPEC, **kw)


def accepted(engine: Engine) -> int:
    return engine.spec_decode_stats["num_accepted_tokens"]


def test_greedy_output_is_the_same_with_drafts(
    make_engine: MakeEngine, chats: list[list[int]], reference: list[list[int]]
) -> None:
    engine = speculative(make_engine, enable_prefix_caching=False)
    copy = engine.generate([chats[0]], GREEDY)[0][0]  # alone: every row of the step sampled
    assert copy == reference[0]
    assert accepted(engine) > 0
    # together: drafted chunks beside plain decodes and prompt chunks
    assert [r[0] for r in engine.generate(chats, GREEDY)] == reference
    stats = engine.spec_decode_stats
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # both paths taken
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    # the counters as workers report them and the gateway exposes them
    report = AsyncEngine(engine).stats()
    assert {k: report[f"spec_decode_{k}"] for k in stats} == stats
    collector = EngineStatsCollector("m")
    collector.snapshot = {"w": report}
    registry = CollectorRegistry()
    registry.register(collector)
    lines = generate_latest(registry).decode().splitlines()
    for key, value in stats.items():
        assert f'kvserve:spec_decode_{key}_total{{model_name="m",worker="w"}} {value:.1f}' in lines


def test_prefix_caching_on_gives_the_same_output(
    make_engine: MakeEngine, chats: list[list[int]], reference: list[list[int]]
) -> None:
    engine = speculative(make_engine)
    first, _ = run_one(engine, "a", chats[1], GREEDY)
    again, cached = run_one(engine, "b", chats[1], GREEDY)
    assert first == again == reference[1]
    assert cached > 0 and accepted(engine) > 0


def test_preemption_under_a_tiny_cache_gives_the_same_output(
    make_engine: MakeEngine, chats: list[list[int]], reference: list[list[int]]
) -> None:
    engine = speculative(make_engine, num_blocks=14, max_num_batched_tokens=64)
    got = [r[0] for r in engine.generate(chats, GREEDY)]
    assert engine.scheduler.num_preemptions > 0 and accepted(engine) > 0
    assert got == reference
    engine.kv.pool.check()
    assert engine.kv.pool.num_free == engine.kv.num_blocks


class Oracle:
    """A drafter that knows the continuation: it proposes the reference's next tokens (all
    accepted), but for the output positions in `wrong`, where it proposes another token."""

    def __init__(self, continuation: list[int], k: int = 4, wrong: tuple[int, ...] = ()) -> None:
        self.continuation, self.k, self.wrong = continuation, k, wrong

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        at = seq.num_output_tokens
        drafts = self.continuation[at : at + min(self.k, limit)]
        return [t + 1 if at + i in self.wrong else t for i, t in enumerate(drafts)]


def stream(
    engine: Engine, rid: str, prompt: list[int], params: SamplingParams
) -> tuple[list[int], str]:
    engine.add_request(rid, prompt, params)
    tokens: list[int] = []
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.completions[0].token_ids
            text += out.completions[0].text
    return tokens, text


def test_max_tokens_inside_an_accepted_run_discards_the_rest(
    make_engine: MakeEngine, chats: list[list[int]], reference: list[list[int]]
) -> None:
    """Drafts past max_tokens (the n-gram proposer never makes them; a drafter may): the run
    ends on the accepted draft that reaches max_tokens, one token fewer than its steps and
    accepted drafts would append."""
    engine = speculative(make_engine)
    engine.scheduler.drafter = Oracle(reference[1])
    for max_tokens in (4, 5, 8, 12):
        steps, acc = engine.num_steps, accepted(engine)
        got, _ = run_one(engine, f"m{max_tokens}", chats[1], SamplingParams(max_tokens=max_tokens))
        assert got == reference[1][:max_tokens]
        # one step for the prompt (one chunk), then each step: its accepted drafts and a token
        cut_short = (engine.num_steps - steps) + (accepted(engine) - acc) - len(got)
        assert cut_short == (max_tokens % 5 != 1)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_stop_strings_inside_an_accepted_run(
    make_engine: MakeEngine, plain: Engine, chats: list[list[int]], reference: list[list[int]]
) -> None:
    stop = SamplingParams(max_tokens=40, stop=("height)",))
    want = stream(plain, "s", chats[1], stop)
    assert want[1] == "```python\ndef area(width, "
    engine = speculative(make_engine)
    assert stream(engine, "ngram", chats[1], stop) == want
    engine.scheduler.drafter = Oracle(reference[1])
    assert stream(engine, "oracle", chats[1], stop) == want


def test_a_rejection_appends_the_targets_token_and_drafts_again(
    make_engine: MakeEngine, chats: list[list[int]], reference: list[list[int]]
) -> None:
    engine = speculative(make_engine)
    engine.scheduler.drafter = Oracle(reference[1], wrong=(3, 4, 9, 17, 18, 19, 20))
    got, _ = run_one(engine, "r", chats[1], GREEDY)
    assert got == reference[1]
    stats = engine.spec_decode_stats
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_a_seeded_sampled_request_draws_the_same_tokens(
    make_engine: MakeEngine, plain: Engine, chats: list[list[int]]
) -> None:
    """The verification draws each position as a plain decode draws it (same seed)."""
    engine = speculative(make_engine, enable_prefix_caching=False)
    params = [
        SamplingParams(max_tokens=32, temperature=t, top_k=k, seed=s)
        for t, k, s in ((0.7, 0, 1), (1.0, 20, 2))
    ]
    for p in params:
        assert engine.generate(chats[:2], p) == plain.generate(chats[:2], p)
    assert accepted(engine) > 0


def test_logprobs_and_min_tokens(
    make_engine: MakeEngine, plain: Engine, chats: list[list[int]]
) -> None:
    engine = speculative(make_engine, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=24, logprobs=True, top_logprobs=2, min_tokens=20)

    def run(e: Engine) -> tuple[list[int], list[float], list[dict[int, float]]]:
        e.add_request("lp", chats[0], params)
        tokens, logprobs, tops = [], [], []
        while e.has_unfinished_requests():
            for out in e.step():
                d = out.completions[0]
                tokens += d.token_ids
                logprobs += d.logprobs
                tops += d.top_logprobs
        return tokens, logprobs, tops

    tokens, logprobs, tops = run(engine)
    want_tokens, want_logprobs, want_tops = run(plain)
    assert tokens == want_tokens and accepted(engine) > 0
    torch.testing.assert_close(
        torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-3, rtol=0
    )
    assert [list(t) for t in tops] == [list(t) for t in want_tops]


def test_published_blocks_hold_no_rejected_draft(
    make_engine: MakeEngine, chats: list[list[int]]
) -> None:
    """After rejections, the blocks in the prefix index are those of a run without drafts:
    the same hashes, and the same K/V in each (a rejected draft's would differ)."""
    params = SamplingParams(max_tokens=60)
    base, spec = make_engine(), speculative(make_engine)
    for e in (base, spec):
        run_one(e, "r", chats[1], params)
    stats = spec.spec_decode_stats
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    index, spec_index = base.kv.pool.index, spec.kv.pool.index
    assert index is not None and spec_index is not None
    assert set(spec_index.hashes()) == set(index.hashes())
    for h in index.hashes():
        a, b = (e.kv.cached_block(h) for e in (base, spec))
        assert a is not None and b is not None
        (want,), (got,) = base.kv.cache.read_blocks([a]), spec.kv.cache.read_blocks([b])
        torch.testing.assert_close(got.k, want.k, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(got.v, want.v, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, n=2, temperature=0.8, seed=3),
        SamplingParams(max_tokens=12, beam_width=2),
    ],
)
def test_n_and_beam_search_run_without_drafts(
    make_engine: MakeEngine, plain: Engine, chats: list[list[int]], params: SamplingParams
) -> None:
    engine = speculative(make_engine, enable_prefix_caching=False)
    assert engine.generate([chats[0]], params) == plain.generate([chats[0]], params)
    assert engine.spec_decode_stats["num_drafts"] == 0


def test_a_resumed_request_continues_the_same_generation(
    make_engine: MakeEngine, chats: list[list[int]], reference: list[list[int]]
) -> None:
    engine = speculative(make_engine)
    full = reference[1]
    engine.add_request("r", chats[1], GREEDY, resume={0: Emitted(full[:9])})
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            rest += out.completions[0].token_ids
    assert full[:9] + rest == full and accepted(engine) > 0


def test_a_disaggregated_hand_off_with_drafts_on_both_sides(
    make_engine: MakeEngine, chats: list[list[int]], reference: list[list[int]], tmp_path: Path
) -> None:
    prompt = chats[1]
    head = prompt[:-1]
    store = StoreConfig(f"file://{tmp_path}")
    pre = speculative(make_engine, store=store)
    try:
        pre.add_request("r1", head, SamplingParams(max_tokens=1), export_tail=True)
        outs = []
        while pre.has_unfinished_requests():
            outs += pre.step()
        tail = outs[-1].kv_tail
        assert tail is not None and pre.spec_decode_stats["num_drafts"] == 0
        assert pre.kv.hand_off("r1", tail)
    finally:
        pre.close()
    dec = speculative(make_engine, store=store)
    try:
        fetched = dec.kv.fetch_tail("r1", tail.token_ids)
        assert fetched is not None
        got = fetched.result(timeout=10)
        tokens, cached = run_one(dec, "r1", prompt, GREEDY, kv_tail=got)
        assert tokens == reference[1] and cached == len(prompt) - 1
        assert accepted(dec) > 0
    finally:
        dec.close()


def test_drafted_decodes_take_the_cpp_decode_path_and_match_a_chunk(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode with drafts runs as decode rows (one a position, each attending up to its own
    token) on the C++ decode step, and its rows' logits are those a prompt chunk over the same
    tokens computes (`Engine.score`)."""
    engine = speculative(make_engine, enable_prefix_caching=False)
    runner = engine.model_runner
    if not runner.model.decode_in_cpp:
        pytest.skip("no C++ decode step on this machine")
    calls: list[int] = []
    real = runner.model._decode_in_cpp
    monkeypatch.setattr(runner.model, "_decode_in_cpp", lambda *a: calls.append(1) or real(*a))
    ids, drafts = list(range(1000, 1040)), [7, 8, 9]
    seq = Sequence(SeqId(0), "r", 0, ids, len(ids), SamplingParams(), 0)
    blocks = engine.kv.allocate_blocks(seq.blocks_needed(len(ids) + 8, engine.block_size))
    assert blocks is not None
    seq.block_table = blocks
    runner.run(Batch([ScheduledSeq(seq, len(ids) - 1)]))
    seq.num_computed_tokens = len(ids) - 1
    plain_out = runner.run(Batch([ScheduledSeq(seq, 1)]))
    if not calls:
        pytest.skip("the C++ decode step does not apply on this machine")
    assert calls == [1] and plain_out.num_drafts is None
    seq.draft_tokens = drafts
    out = runner.run(Batch([ScheduledSeq(seq, 4, 3)]))
    assert calls == [1, 1] and out.num_drafts == (3,) and out.logits.shape[0] == 4
    engine.kv.free_blocks(blocks)
    want = engine.score(ids + drafts)[len(ids) - 1 :]
    torch.testing.assert_close(out.logits, want, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out.logits[0], plain_out.logits[0], atol=1e-3, rtol=1e-3)
