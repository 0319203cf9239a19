"""The Sampler's tokens and logprobs against torch's log-softmax of the same logits, and the
rejection rule that verifies a speculative draft against the distribution it must keep."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kvserve.kernels import cpu_ops
from kvserve.shared.engine.sampler import (
    Sampler,
    SampleRow,
    apply_top_k_top_p,
    draw,
    to_host,
    verify_draft,
)
from kvserve.shared.sampling_params import SamplingParams


def test_greedy_tokens_and_logprobs_are_the_log_softmax_of_the_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 1000) * 4
    rows = [SampleRow(SamplingParams(max_tokens=1), None) for _ in range(5)]
    tokens, logprobs, tops = Sampler().sample(logits, rows)
    want = torch.log_softmax(logits, dim=-1)
    assert tokens == logits.argmax(-1).tolist()
    torch.testing.assert_close(
        torch.tensor(logprobs), want.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    )
    assert tops == [None] * 5


def test_sampled_rows_report_the_models_logprob_and_top_alternatives() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 500) * 3
    gen = torch.Generator().manual_seed(7)
    rows = [
        SampleRow(SamplingParams(max_tokens=1, temperature=0.7, top_logprobs=3), gen),
        SampleRow(SamplingParams(max_tokens=1, top_logprobs=5), None),
    ]
    tokens, logprobs, tops = Sampler().sample(logits, rows)
    want = torch.log_softmax(logits, dim=-1)
    for i, k in enumerate((3, 5)):
        # The chosen token's logprob is of the raw distribution, not the temperature-scaled one.
        assert abs(logprobs[i] - want[i, tokens[i]].item()) < 1e-5
        top = tops[i]
        assert top is not None and len(top) == k
        values, ids = torch.topk(want[i], k)
        assert list(top) == ids.tolist()
        torch.testing.assert_close(torch.tensor(list(top.values())), values)


def test_one_copy_to_the_host_gives_each_tensors_own_values() -> None:
    """A device's results come back in one float64 copy (to_host): the same tokens, logprobs
    and top logprobs, in the same order, as each tensor's own tolist (what the CPU returns)."""
    torch.manual_seed(2)
    logits = torch.randn(4, 300) * 5
    lse = torch.logsumexp(logits, dim=-1)
    tokens = torch.tensor([299, 0, 17, 150])
    chosen = logits.gather(1, tokens[:, None])[:, 0] - lse
    asked = [(i, *torch.topk(logits[i] - lse[i], k)) for i, k in ((0, 3), (2, 1), (3, 20))]
    got = to_host(tokens, chosen, asked)
    tops: list[dict[int, float] | None] = [None] * 4
    for i, values, ids in asked:
        tops[i] = dict(zip(ids.tolist(), values.tolist(), strict=True))
    assert got == (tokens.tolist(), chosen.tolist(), tops)
    assert [list(t) for t in got[2] if t] == [list(t) for t in tops if t]  # key order too
    assert all(type(t) is int for t in got[0])


def test_without_the_fused_kernel_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 300) * 3
    rows = [SampleRow(SamplingParams(max_tokens=1, top_logprobs=2), None) for _ in range(4)]
    fused = Sampler().sample(logits, rows)
    monkeypatch.setattr(cpu_ops, "_extension", lambda: None)
    plain = Sampler().sample(logits, rows)
    assert fused[0] == plain[0]
    torch.testing.assert_close(torch.tensor(fused[1]), torch.tensor(plain[1]))


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(5e-324, 1.0), (1e-40, 1.0), (1e-6, 1.0), (0.8, 5e-324)]
)
def test_extreme_temperature_or_top_p_draws_the_most_likely_token(
    temperature: float, top_p: float
) -> None:
    """A temperature below GREEDY_BELOW is greedy and a tiny top_p keeps the top token alone,
    where dividing by the one or comparing with the other in float32 would give NaN
    probabilities (and an exception on the engine thread)."""
    torch.manual_seed(3)
    logits = torch.randn(1, 400) * 8
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p)
    rows = [SampleRow(params, torch.Generator().manual_seed(1))]
    tokens, _, _ = Sampler().sample(logits, rows)
    assert tokens == [int(logits.argmax())]


def test_draws_follow_the_distribution_and_skip_zero_probabilities() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0]) * 3  # unnormalised, zeros inside
    gen = torch.Generator()
    counts = torch.zeros(6)
    draws = 20_000
    for seed in range(draws):
        counts[draw(probs, gen.manual_seed(seed))] += 1
    assert counts[[0, 2, 5]].sum() == 0
    # within 4 standard deviations of a binomial count
    expected = probs / probs.sum() * draws
    assert ((counts - expected).abs() <= 4 * (expected * (1 - expected / draws)).sqrt() + 1).all()
    assert draw(probs, gen.manual_seed(7)) == draw(probs, gen.manual_seed(7))


# ---- speculative decoding: the draft's rejection sampling ------------------------------------

DraftRule = Callable[[torch.Tensor, int, torch.Generator], int]


def _always_accept(probs: torch.Tensor, d: int, gen: torch.Generator) -> int:
    return d


def _redraw_with_the_draft(probs: torch.Tensor, d: int, gen: torch.Generator) -> int:
    """Accept with probability p(d), on rejection draw from p itself (d's mass not removed)."""
    if float(torch.rand((), generator=gen)) < float(probs[d] / probs.sum()):
        return d
    return draw(probs, gen)


def _verification_stats(
    rule: DraftRule, probs: torch.Tensor, d: int, trials: int = 20_000
) -> tuple[float, float, float]:
    """(|acceptance rate - p(d)|, total variation of the tokens from p, total variation of the
    rejections' tokens from p with d's mass removed), over `trials` seeded draws."""
    p = probs / probs.sum()
    gen = torch.Generator()
    tokens = torch.tensor([rule(probs, d, gen.manual_seed(seed)) for seed in range(trials)])
    counts = torch.bincount(tokens, minlength=len(p)).double()
    rejected = torch.bincount(tokens[tokens != d], minlength=len(p)).double()
    rest = p.double().clone()
    rest[d] = 0
    tv = 0.5 * float((counts / trials - p).abs().sum())
    tv_rejected = 0.5 * float(
        (rejected / max(1.0, float(rejected.sum())) - rest / rest.sum()).abs().sum()
    )
    return abs(float(counts[d]) / trials - float(p[d])), tv, tv_rejected


SPEC_PARAMS = SamplingParams(max_tokens=1, temperature=0.8, top_k=5)
SPEC_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.2, -1.0])


def _processed() -> torch.Tensor:
    """SPEC_LOGITS as SPEC_PARAMS' rows draw from them: top 5 of temperature 0.8."""
    p = SPEC_PARAMS
    return torch.softmax(apply_top_k_top_p(SPEC_LOGITS / p.temperature, p.top_k, p.top_p), -1)


@pytest.mark.parametrize("draft", [1, 0, 5])
def test_verifying_a_draft_keeps_the_target_distribution(draft: int) -> None:
    """Accepted with probability p(d), a rejection's token from p without d, renormalised,
    so every token is drawn from p (the draft 5 is outside top-k: never accepted)."""
    probs = _processed()
    accept_err, tv, tv_rejected = _verification_stats(verify_draft, probs, draft)
    # binomial standard deviations are <= 0.0036 (acceptance), TV about 0.005 by chance
    assert accept_err < 0.015 and tv < 0.02 and tv_rejected < 0.025


@pytest.mark.parametrize("rule", [_always_accept, _redraw_with_the_draft])
def test_a_wrong_verification_rule_fails_the_same_bounds(rule: DraftRule) -> None:
    accept_err, tv, tv_rejected = _verification_stats(rule, _processed(), 1)
    assert not (accept_err < 0.015 and tv < 0.02 and tv_rejected < 0.025)


def test_a_drafted_sampled_row_draws_by_the_verification_rule() -> None:
    """Sampler rows that carry a draft give verify_draft's token for the same generator
    state, which is also what the row draws without a draft (seeded runs stay the same)."""
    probs = _processed()
    gen = torch.Generator()
    for seed in range(200):
        row = SampleRow(SPEC_PARAMS, gen.manual_seed(seed), draft=1)
        (token,), _, _ = Sampler().sample(SPEC_LOGITS[None].clone(), [row])
        (plain,), _, _ = Sampler().sample(
            SPEC_LOGITS[None].clone(), [SampleRow(SPEC_PARAMS, gen.manual_seed(seed))]
        )
        assert token == verify_draft(probs, 1, gen.manual_seed(seed)) == plain


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_beam_search_step_takes_a_devices_logprobs() -> None:
    """The beams' scores go to the logprobs' device: the same candidates as on the CPU."""
    from kvserve.shared.engine.beam_search import BeamSearch

    torch.manual_seed(4)
    logprobs = torch.log_softmax(torch.randn(2, 50), dim=-1)
    searches = [BeamSearch(2, 5, {0}) for _ in range(2)]
    for search in searches:
        search.beams, search.scores = [[1], [2]], [-0.5, -0.7]
    assert searches[0].step(logprobs.cuda()) == searches[1].step(logprobs)
