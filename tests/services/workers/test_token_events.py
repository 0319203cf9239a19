"""What a worker taking a request over learns from the events already emitted for it."""

from __future__ import annotations

from kvserve.services.workers.token_events import taken_over
from kvserve.shared.protocol import ErrorInfo, TokenEvent


def ev(seq: int, index: int, tokens: list[int], text: str, finish: str | None = None) -> TokenEvent:
    return TokenEvent("r", seq, index, tokens, text, finish_reason=finish)


def test_the_first_event_of_each_seq_counts_in_seq_order() -> None:
    events = [
        ev(0, 0, [1], "a"),
        ev(1, 1, [7], "x"),
        ev(0, 0, [9], "z"),  # a duplicate of seq 0 (a run that started again): dropped
        ev(3, 0, [3], "c"),
        ev(2, 0, [2], "b"),
        ev(4, 1, [8], "y", "stop"),
    ]
    got = taken_over(events, n=2)
    assert got.next_seq == 5 and not got.ended and got.output_tokens == 5
    assert got.completions[0].token_ids == [1, 2, 3] and got.completions[0].text == "abc"
    assert not got.completions[0].finished
    assert got.completions[1].token_ids == [7, 8] and got.completions[1].finished
    assert got.finished == {1}


def test_nothing_is_left_to_run_after_an_error_or_every_finish() -> None:
    assert taken_over([], n=1).next_seq == 0
    assert not taken_over([], n=1).ended
    assert taken_over([ev(0, 0, [1], "a", "length")], n=1).ended
    failed = TokenEvent("r", 1, error=ErrorInfo("boom"))
    assert taken_over([ev(0, 0, [1], "a"), failed], n=1).ended
