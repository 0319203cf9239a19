"""What a perfect prefix cache could have served (services/bench/lib/reuse.py): whole shared
blocks of earlier prompts and answers, never the last prompt token."""

from __future__ import annotations

import pytest
from kvserve.services.bench.lib.reuse import ReuseTracker


def test_reuse_counts_a_shared_system_prompt_from_the_second_request() -> None:
    system = list(range(1000, 1040))  # 40 tokens: two whole 16-token blocks and 8 more
    reuse = ReuseTracker(16)
    assert reuse.observe(system + list(range(1, 11))) == 0
    assert reuse.observe(system + list(range(11, 21))) == 32  # whole blocks only, not 40
    assert reuse.observe(list(range(2000, 2050))) == 0


def test_reuse_counts_the_previous_prompt_and_answer_of_a_follow_up_round() -> None:
    prompt, answer, question = list(range(1000, 1044)), [7, 8, 9, 10], list(range(1, 13))
    reuse = ReuseTracker(16)
    assert reuse.observe(prompt) == 0
    follow_up = prompt + answer + question  # 60 tokens; the 3rd block ends with the answer
    assert reuse.reusable(follow_up) == 32  # the prompt's two whole blocks
    reuse.add(prompt + answer)
    assert reuse.observe(follow_up) == 48


def test_reuse_never_counts_the_last_prompt_token() -> None:
    reuse = ReuseTracker(16)
    reuse.add(list(range(1000, 1064)))
    assert reuse.reusable(list(range(1000, 1032))) == 16  # at most (32 - 1) // 16 blocks
    assert reuse.reusable(list(range(1000, 1033))) == 32
    assert reuse.reusable([1000]) == 0 and reuse.reusable([]) == 0
    with pytest.raises(ValueError):
        ReuseTracker(0)
