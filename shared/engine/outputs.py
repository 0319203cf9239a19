"""What the engine hands out: per request, the deltas of each completion since the last output
(`RequestOutput`), and the per-completion state that produces them (`Completion`: incremental
detokenization, stop strings, what was already sent)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.shared.engine.sequence import Sequence
from kvserve.shared.model.tokenizer import IncrementalDetokenizer
from kvserve.shared.store.block_data import KVTail


@dataclass
class CompletionDelta:
    """What one completion (one of n, or the best beam) produced since the last output."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None = None
    # with SamplingParams.top_logprobs: per token, {token id: logprob} of the most likely ones
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    completions: list[CompletionDelta]
    finished: bool
    kv_tail: KVTail | None = None  # with export_tail, on the finished output
    # num_cached_tokens by the tier they came from ("device", "host", "store"; they sum to it)
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    store_lookup: str | None = None  # how the store lookup ended (None: the store not asked)
    # The request failed (failure.RequestFailedError): its last output, with no completions.
    error: BaseException | None = None


@dataclass(frozen=True)
class Emitted:
    """What a client already received of one completion when its request moves to another
    worker (exact-token resumption): the output tokens, their text, and whether the completion
    finished there."""

    token_ids: list[int]
    text: str = ""
    finished: bool = False


@dataclass
class Completion:
    """One completion's text as it grows (detokenized token by token, cut at a stop string)
    and how much of it, and of its tokens, has been emitted."""

    seq: Sequence
    detok: IncrementalDetokenizer
    sent_tokens: int = 0
    sent_text: int = 0
    text: str = ""  # full text so far (truncated at a stop string once found)

    def add(self, token: int) -> None:
        self.text += self.detok.add(token)

    def prime(self, emitted: Emitted) -> None:
        """Take up a completion whose first tokens were already sent: detokenize them (so text
        and stop strings continue across the boundary) and count them, and the text the client
        got, as sent."""
        for token in emitted.token_ids:
            self.add(token)
        self.sent_tokens = len(emitted.token_ids)
        self.sent_text = min(len(emitted.text), len(self.text))

    def cut_at_stop(self, stop: tuple[str, ...]) -> bool:
        """Cut the text before the first stop string in it; True if there was one. Only the
        new text (plus a stop string's length before it) can hold a new match."""
        window = max(len(s) for s in stop) + 32
        start = max(0, len(self.text) - window)
        hits = [i for s in stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
        return bool(hits)

    def delta(self, index: int, hold: int) -> CompletionDelta:
        """What the completion produced since the last call; text that could still become
        a stop string (`hold` characters) is held back unless the completion is done."""
        seq = self.seq
        toks = seq.output_token_ids
        visible = len(self.text) if seq.is_finished else max(self.sent_text, len(self.text) - hold)
        delta = CompletionDelta(
            index=index,
            token_ids=toks[self.sent_tokens :],
            text=self.text[self.sent_text : visible],
            logprobs=seq.logprobs[self.sent_tokens :] if seq.params.logprobs else [],
            top_logprobs=seq.top_logprobs[self.sent_tokens :] if seq.params.logprobs else [],
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
        )
        self.sent_tokens, self.sent_text = len(toks), visible
        return delta
