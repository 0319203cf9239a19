"""TokenEmitter: turns one request's RequestOutputs into numbered token events on the bus; and
`taken_over`: what a request's earlier run emitted, for the worker that takes it over."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.shared.bus.base import WorkerPort
from kvserve.shared.engine.outputs import Emitted, RequestOutput
from kvserve.shared.protocol import ErrorInfo, TokenEvent, error_event


@dataclass
class TakenOver:
    """What a request's earlier run (on a worker that died, or here before a bus failure)
    emitted, as the gateway keeps it: the first event of each seq, in seq order."""

    next_seq: int = 0
    completions: dict[int, Emitted] = field(default_factory=dict)
    ended: bool = False  # an error or every completion's finish was emitted: nothing to run
    output_tokens: int = 0

    @property
    def finished(self) -> frozenset[int]:
        return frozenset(i for i, c in self.completions.items() if c.finished)


def taken_over(events: list[TokenEvent], n: int) -> TakenOver:
    """Fold the events emitted so far (duplicates and all, in the order they were written)
    into what the client has, as the gateway reads them (stale epochs dropped): per
    completion index its tokens, its text and whether it finished."""
    first: dict[int, TokenEvent] = {}
    epoch = 0
    for ev in events:
        if ev.epoch < epoch:
            continue
        epoch = ev.epoch
        if not ev.is_fence:
            first.setdefault(ev.seq, ev)
    out = TakenOver()
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    done: set[int] = set()
    while out.next_seq in first:  # a worker emits in seq order: there is no gap to skip
        ev = first[out.next_seq]
        out.next_seq += 1
        if ev.error is not None:
            out.ended = True
            continue
        tokens.setdefault(ev.index, []).extend(ev.token_ids)
        texts[ev.index] = texts.get(ev.index, "") + ev.text
        out.output_tokens += len(ev.token_ids)
        if ev.finish_reason is not None:
            done.add(ev.index)
    out.completions = {
        i: Emitted(tokens.get(i, []), texts.get(i, ""), i in done) for i in tokens.keys() | done
    }
    out.ended = out.ended or len(done) >= n
    return out


def by_tier(by_source: dict[str, int], cached_tokens: int) -> dict[str, int]:
    """The cached tokens by tier, cut to `cached_tokens`, fastest tier first (a taken-over
    request's cached prefix also holds its emitted tokens; only the prompt's count)."""
    out: dict[str, int] = {}
    left = cached_tokens
    for tier in ("device", "host", "store"):
        out[tier] = min(by_source.get(tier, 0), left)
        left -= out[tier]
    return out


class TokenEmitter:
    """Owns the request's event numbering: events carry seq 0, 1, 2, ... in emission order;
    one event per completion delta that has tokens, text or a finish reason. Counts what it
    emitted (output tokens, the latest cached-token count) for the request's span."""

    def __init__(
        self,
        port: WorkerPort,
        request_id: str,
        num_prompt_tokens: int,
        taken: TakenOver | None = None,
        epoch: int = 1,
    ) -> None:
        """With `taken` (the request was taken over), numbering goes on after its events and
        the completions that finished there emit nothing more."""
        self.port = port
        self.epoch = epoch
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.seq = taken.next_seq if taken is not None else 0
        self.output_tokens = taken.output_tokens if taken is not None else 0
        self.done_before = taken.finished if taken is not None else frozenset()
        self.cached_tokens = 0
        self.cached_tokens_by_source: dict[str, int] = {}
        self.store_lookup: str | None = None

    async def deltas(self, output: RequestOutput) -> None:
        # A taken-over request also finds its emitted tokens cached: count the prompt's only.
        self.cached_tokens = min(output.num_cached_tokens, self.num_prompt_tokens)
        self.cached_tokens_by_source = by_tier(output.cached_tokens_by_source, self.cached_tokens)
        self.store_lookup = output.store_lookup
        for c in output.completions:
            if not (c.token_ids or c.text or c.finish_reason) or c.index in self.done_before:
                continue
            self.output_tokens += len(c.token_ids)
            await self.port.emit(
                TokenEvent(
                    request_id=self.request_id,
                    seq=self.seq,
                    index=c.index,
                    token_ids=list(c.token_ids),
                    text=c.text,
                    logprobs=[float(x) for x in c.logprobs],
                    top_logprobs=[
                        [[int(t), float(v)] for t, v in top.items()] for top in c.top_logprobs
                    ],
                    finish_reason=c.finish_reason,
                    num_prompt_tokens=self.num_prompt_tokens,
                    num_cached_tokens=self.cached_tokens,
                    cached_tokens_by_source=dict(self.cached_tokens_by_source),
                    store_lookup=self.store_lookup,
                    epoch=self.epoch,
                )
            )
            self.seq += 1

    async def error(self, info: ErrorInfo) -> None:
        """The request's terminal event."""
        await self.port.emit(error_event(self.request_id, self.seq, info, self.epoch))
        self.seq += 1
