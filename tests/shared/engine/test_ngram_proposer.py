"""The n-gram proposer (prompt lookup): the longest suffix that occurs earlier wins, its latest
earlier occurrence is copied, at most K tokens, nothing without a match; a copy that runs into
the suffix goes on over itself; and the caps and exclusions the engine relies on (max_tokens,
the scheduler's limit, n > 1, beam search), with a mirror that follows the growing tokens."""

from __future__ import annotations

import pytest
from kvserve.shared.config import SpeculativeConfig
from kvserve.shared.engine.ngram_proposer import NgramProposer, propose
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.engine.helpers import prompt_sequence


def test_the_tokens_after_the_earlier_occurrence_are_proposed() -> None:
    #          0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert propose(tokens, 3, 1, 4) == [8, 9, 1]
    assert propose(tokens, 1, 1, 4) == [8]  # K caps the proposal


def test_no_earlier_occurrence_proposes_nothing() -> None:
    assert propose([1, 2, 3, 4, 5], 4, 1, 4) == []
    assert propose([7], 4, 1, 4) == []  # nothing before the suffix at all
    # the suffix of 2 occurs earlier, but min 3 asks for longer ones only
    assert propose([1, 2, 9, 3, 1, 2], 4, 3, 4) == []
    assert propose([1, 2, 9, 3, 1, 2], 4, 2, 4) == [9, 3, 1, 2]


def test_the_longest_matching_suffix_wins_over_a_later_shorter_match() -> None:
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 40, 9, 3, 50, 1, 2, 3]
    # "3" last occurs at 5 (-> 50), but "1 2 3" occurs at 0..2 (-> 40, 9)
    assert propose(tokens, 2, 1, 4) == [40, 9]
    assert propose(tokens, 2, 1, 1) == [50, 1]  # max 1: only the last token is looked up


def test_the_latest_earlier_occurrence_is_copied() -> None:
    #          0  1  2  3  4  5  6  7  8
    tokens = [4, 5, 10, 4, 5, 20, 30, 4, 5]
    assert propose(tokens, 2, 1, 2) == [20, 30]


def test_a_copy_that_reaches_the_suffix_continues_over_itself() -> None:
    # "a b" last occurs at 1..2: after it come "a b", then the copy's own "a b ..."
    assert propose([9, 1, 2, 1, 2], 5, 1, 2) == [1, 2, 1, 2, 1]
    assert propose([3, 3, 3], 4, 1, 4) == [3, 3, 3, 3]


def test_an_occurrence_across_token_boundaries_is_not_a_match() -> None:
    # as bytes, 0x00000100 0x00000200 holds 0x00020000 at offset 1 (little-endian): the
    # search must skip such a hit and find no token-aligned one
    assert propose([256, 512, 7, 131072], 2, 1, 1) == []
    assert propose([131072, 8, 256, 512, 7, 131072], 2, 1, 1) == [8, 256]


def _seq(tokens: list[int], **params: object):  # type: ignore[no-untyped-def]
    seq = prompt_sequence(0, tokens, SamplingParams(**params))  # type: ignore[arg-type]
    seq.num_prompt_tokens = 2
    return seq


def test_the_proposer_keeps_to_k_the_limit_and_max_tokens() -> None:
    prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2))
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    seq = _seq(tokens, max_tokens=100)
    assert prop.propose(seq, 16) == [3, 4, 5]
    assert prop.propose(seq, 2) == [3, 4]  # the scheduler's budget
    # 7 outputs of 9 allowed: the verification appends one token anyway, so one draft
    assert prop.propose(_seq(tokens, max_tokens=9), 16) == [3]
    assert prop.propose(_seq(tokens, max_tokens=8), 16) == []


@pytest.mark.parametrize("params", [{"n": 2}, {"beam_width": 2}])
def test_n_and_beam_search_get_no_drafts(params: dict[str, int]) -> None:
    prop = NgramProposer(SpeculativeConfig(prompt_lookup_min=1))
    assert prop.propose(_seq([1, 2, 3, 1, 2], max_tokens=50), 16) == [3, 1, 2, 3]
    assert prop.propose(_seq([1, 2, 3, 1, 2], max_tokens=50, **params), 16) == []


def test_the_mirror_follows_appended_tokens() -> None:
    prop = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1)
    )
    seq = _seq([1, 2, 3, 4], max_tokens=100)
    assert prop.propose(seq, 16) == []
    seq.token_ids += [9, 1, 2]  # appended since: the mirror takes them in
    assert prop.propose(seq, 16) == [3, 4]
    seq.token_ids.append(5)
    assert prop.propose(seq, 16) == []
    other = _seq([1, 2, 3, 1], max_tokens=100)  # a mirror per sequence
    assert prop.propose(other, 16) == [2, 3]
