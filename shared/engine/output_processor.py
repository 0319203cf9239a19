"""OutputProcessor: a step's logits turned into tokens, forks, stops and outputs.

After the model call: beam requests stash their rows and advance when every live beam has one;
every other sampling sequence draws one token (a sequence with pending n > 1 siblings draws
once per sibling from the same row and forks them, sharing its blocks); a sequence with draft
tokens verifies them (`_verify`); tokens are appended, stops detected (stop tokens, EOS, stop
strings, max_tokens, the context window), and each touched request yields its deltas. A
finished request leaves the table here.

Verification (speculative decoding): row j of a drafted sequence is drawn as a decode at that
position would draw it (its seed, its min_tokens suppression), once rows 0..j-1 were appended;
the row's token is appended, and the next row counts only while each token is the draft it
verifies (greedy: the argmax; sampled: `sampler.verify_draft`). So the first mismatch, or the
bonus row after every draft was accepted, ends the run, and so does the first token that
finishes the sequence (the rest is discarded). Each accepted draft's K/V, written by this step,
then counts as computed and its newly full blocks are published; a rejected draft's slots
are left to be overwritten, beyond `num_computed_tokens`, in no published block.

Deferred output (`process(out, defer=True)`, the engine's overlapped step): everything that
decides what runs next happens at once (the tokens, their logprobs, stops on token ids, EOS,
length and, for a request with stop strings, its text); the text of the other requests and
every touched request's output wait for `emit()`, which the engine runs as the next step's
model call begins (on another thread while it runs, where the call leaves a core). `emit()`
never runs beside `process`: it touches only the completions and the request table, which
nothing else touches during a model call.

Mutates: the request table (shared with the Engine), sequences' tokens, logprobs, drafts and
(for accepted drafts) computed tokens; finishes sequences and adds forks through the
Scheduler; forks share blocks and accepted drafts' blocks are published through the KV
manager.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from kvserve.shared.engine.beam_search import BeamGroup, BeamSearch
from kvserve.shared.engine.failure import inject_request_fault
from kvserve.shared.engine.kv.manager import KVCacheManager
from kvserve.shared.engine.model_runner import StepOutput
from kvserve.shared.engine.outputs import Completion, RequestOutput
from kvserve.shared.engine.request import Request, SequenceFactory
from kvserve.shared.engine.sampler import Sampler, SampleRow, position_seed
from kvserve.shared.engine.scheduler import Scheduler
from kvserve.shared.engine.sequence import FinishReason, SeqId, Sequence, SequenceStatus
from kvserve.shared.sampling_params import SamplingParams

Draw = tuple[int, float, dict[int, float] | None]  # a row's token, its logprob, top logprobs


@dataclasses.dataclass
class SpecDecodeStats:
    """Speculative decoding's counters (vLLM's spec_decode names): verification steps of a
    sequence with drafts, draft tokens verified, and those accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted


class OutputProcessor:
    def __init__(
        self,
        requests: dict[str, Request],
        factory: SequenceFactory,
        kv: KVCacheManager,
        scheduler: Scheduler,
        eos_token_ids: set[int],
        max_model_len: int,
    ) -> None:
        self.requests = requests
        self.factory = factory
        self.kv = kv
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.sampler = Sampler()
        self.spec_decode = SpecDecodeStats()
        # n > 1 siblings created while their parent's row is sampled, forked right after.
        self._pending_children: dict[tuple[SeqId, int], Sequence] = {}
        # Requests whose own processing raised in this step (take_failed), with the exception.
        self.failed: dict[str, BaseException] = {}
        # Deferred (process(defer=True)) until emit(): tokens to detokenize, requests to output.
        self._defer = False
        self._untexted: list[tuple[Completion, int]] = []
        self._unemitted: dict[str, None] = {}

    def process(self, out: StepOutput, defer: bool = False) -> list[RequestOutput]:
        """The outputs of the requests this step's sampled rows touched. A request whose own
        processing raised is left out and named in `take_failed()` (its sequences untouched
        since, for the engine to abort); the others go on. With `defer`, their text (where no
        stop string needs it now) and their outputs wait for `emit()`; returns what an
        earlier deferred call left (emitted first: a completion's text grows in order)."""
        earlier = self.emit() if self.has_unemitted else []
        self._defer = defer
        try:
            touched = self._process(out)
        finally:
            self._defer = False
        if defer:
            self._unemitted.update(dict.fromkeys(touched))
            return earlier
        return earlier + self._outputs(touched)

    def draw(self, out: StepOutput) -> list[Draw | None]:
        """Each sequence's token of a step of plain decodes (one row each: no beams, drafts or
        forks), drawn as `process` draws it, nothing appended: the engine's next model call can
        take them before `apply` makes the step's outputs. None: the row's request failed."""
        seqs = out.sampling_seqs
        if out.argmax is not None and all(self._plain_greedy(seq) for seq in seqs):
            return [(t, lp, None) for t, lp in zip(*out.argmax, strict=True)]
        kept: list[int] = []
        rows: list[SampleRow] = []
        for i, seq in enumerate(seqs):
            with self._blame(seq.request_id):
                rows.append(self._sample_row(seq, -1))
                kept.append(i)
        logits = out.logits if len(kept) == len(seqs) else out.logits[kept]
        drawn: list[Draw | None] = [None] * len(seqs)
        owners = [seqs[i].request_id for i in kept]
        for i, d in zip(kept, self._draw(logits, rows, owners, out), strict=True):
            drawn[i] = d
        return drawn

    def _plain_greedy(self, seq: Sequence) -> bool:
        """Whether the sequence's next token is its logits' argmax, with no top logprobs and
        nothing suppressed: what a model call that drew the argmax (`StepOutput.argmax`) made."""
        p = seq.params
        return p.greedy and not p.top_logprobs and not self._suppressed(seq)

    def apply(self, out: StepOutput, drawn: list[Draw | None]) -> list[RequestOutput]:
        """`process` for the tokens `draw` drew: appended (stops detected), then the outputs
        of the requests they touched, after what an earlier deferred `process` left."""
        earlier = self.emit() if self.has_unemitted else []
        touched: dict[str, None] = {}
        for seq, d in zip(out.sampling_seqs, drawn, strict=True):
            if d is None or seq.request_id in self.failed:
                continue
            with self._blame(seq.request_id):
                self._append(seq, *d)
                touched[seq.request_id] = None
        return earlier + self._outputs(list(touched))

    @property
    def has_unemitted(self) -> bool:
        """Whether a deferred `process` left text or outputs for `emit()`."""
        return bool(self._unemitted or self._untexted)

    def emit(self) -> list[RequestOutput]:
        """The outputs that deferred `process` calls left: their tokens' text, then each
        touched request's output (a request that left the table meanwhile has none)."""
        untexted, self._untexted = self._untexted, []
        for comp, token in untexted:
            rid = comp.seq.request_id
            if rid not in self.failed:
                with self._blame(rid):
                    comp.add(token)
        touched, self._unemitted = list(self._unemitted), {}
        return self._outputs(touched)

    def _outputs(self, touched: list[str]) -> list[RequestOutput]:
        outputs = []
        for rid in touched:
            if rid in self.requests and rid not in self.failed:
                with self._blame(rid):
                    outputs.append(self._output(self.requests[rid]))
        return outputs

    def _process(self, out: StepOutput) -> list[str]:
        """Sample, verify or advance beams; the requests touched."""
        seqs = out.sampling_seqs
        beam = [i for i, q in enumerate(seqs) if self.requests[q.request_id].beam]
        spans = out.row_spans()
        drafted = [i for i, (a, b) in enumerate(spans) if b - a > 1]
        if beam or drafted:
            touched = []
            if beam:
                rows = [spans[i][0] for i in beam]
                touched += self._beam_step([seqs[i] for i in beam], out.by_token_id()[rows])
            aside = set(beam) | set(drafted)
            keep = [i for i in range(len(seqs)) if i not in aside]
            rows = [spans[i][0] for i in keep]
            touched += self._sample([seqs[i] for i in keep], out.logits[rows], out)
            if drafted:
                logits = [out.logits[spans[i][0] : spans[i][1]] for i in drafted]
                touched += self._verify([seqs[i] for i in drafted], logits, out)
        else:
            touched = self._sample(seqs, out.logits, out)
        return touched

    def take_failed(self) -> dict[str, BaseException]:
        """The requests whose processing raised since the last call, with their exception."""
        failed, self.failed = self.failed, {}
        return failed

    @contextlib.contextmanager
    def _blame(self, request_id: str) -> Iterator[None]:
        """Pin an exception raised inside on `request_id` (the first one counts)."""
        try:
            yield
        except Exception as e:
            self.failed.setdefault(request_id, e)
            for key in [k for k, c in self._pending_children.items() if c.request_id == request_id]:
                del self._pending_children[key]

    def beam_group(self, params: SamplingParams, seq: Sequence) -> BeamGroup:
        """The beam search of a request whose first beam is `seq`."""
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        search = BeamSearch(
            params.beam_width,
            params.max_tokens,
            eos,
            params.length_penalty,
            params.early_stopping,
        )
        return BeamGroup(search, [seq])

    # ---- sampling ---------------------------------------------------------------------------

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, out: StepOutput) -> list[str]:
        """Sample one token per sequence; a sequence with pending forks samples once per
        sibling from the same row and forks the siblings, sharing its blocks. `out` says which
        token each column of `logits` stands for."""
        row_idx: list[int] = []
        targets: list[tuple[Sequence, int]] = []  # (sequence, sibling index or -1 for itself)
        rows: list[SampleRow] = []
        for i, seq in enumerate(seqs):
            mine = [(seq, -1)] + [(seq, j + 1) for j in range(seq.pending_forks)]
            with self._blame(seq.request_id):
                rows += [self._sample_row(q, j) for q, j in mine]
                row_idx += [i] * len(mine)
                targets += mine
        if len(row_idx) != len(seqs):
            logits = logits[torch.tensor(row_idx, dtype=torch.long)]
        drawn = self._draw(logits, rows, [q.request_id for q, _ in targets], out)
        touched: dict[str, None] = {}
        # Fork every sibling before any token is appended: a parent that stops on its first
        # token frees its blocks, which the siblings must already share.
        owners: list[Sequence | None] = []
        for seq, j in targets:
            owners.append(None)
            if seq.request_id not in self.failed:
                with self._blame(seq.request_id):
                    owners[-1] = seq if j < 0 else self._fork(seq, j)
        for owner, draw in zip(owners, drawn, strict=True):
            if owner is None or draw is None or owner.request_id in self.failed:
                continue
            with self._blame(owner.request_id):
                self._append(owner, *draw)
                touched[owner.request_id] = None
        for seq in seqs:
            seq.pending_forks = 0
        return list(touched)

    def _draw(
        self, logits: torch.Tensor, rows: list[SampleRow], owners: list[str], out: StepOutput
    ) -> list[tuple[int, float, dict[int, float] | None] | None]:
        """(token, logprob, top logprobs) per row: all rows at once; when that raises, each
        request's rows apart, so that the request it came from fails alone (None rows)."""
        try:
            return self._draw_rows(logits, rows, out)
        except Exception:
            pass
        drawn: list[tuple[int, float, dict[int, float] | None] | None] = [None] * len(rows)
        for rid in dict.fromkeys(owners):
            idx = [i for i, o in enumerate(owners) if o == rid]
            with self._blame(rid):
                mine = self._draw_rows(logits[idx], [rows[i] for i in idx], out)
                for i, d in zip(idx, mine, strict=True):
                    drawn[i] = d
        return drawn

    def _draw_rows(
        self, logits: torch.Tensor, rows: list[SampleRow], out: StepOutput
    ) -> list[tuple[int, float, dict[int, float] | None] | None]:
        if not rows:
            return []
        if out.columns is not None and any(r.suppressed for r in rows):  # ids -> columns
            at = {t: j for j, t in enumerate(out.columns)}
            rows = [
                dataclasses.replace(r, suppressed=tuple(at[t] for t in r.suppressed if t in at))
                for r in rows
            ]
        columns, logprobs, tops = self.sampler.sample(logits, rows)
        tokens = [out.token_id(c) for c in columns]
        if out.columns is not None:
            tops = [None if t is None else {out.token_id(c): p for c, p in t.items()} for t in tops]
        return list(zip(tokens, logprobs, tops, strict=True))

    def _sample_row(self, seq: Sequence, sibling: int) -> SampleRow:
        if sibling >= 0:  # the sibling is created now, and samples its own first token
            req = self.requests[seq.request_id]
            child = self.factory.completion(req, sibling, seq.token_ids)
            self._pending_children[(seq.seq_id, sibling)] = child
            seq = child
        gen = seq.generator
        if gen is not None:
            seed = self.requests[seq.request_id].seed
            gen.manual_seed(position_seed(seed, seq.index, seq.num_output_tokens))
        return SampleRow(seq.params, gen, self._suppressed(seq))

    def _suppressed(self, seq: Sequence, ahead: int = 0) -> tuple[int, ...]:
        """The token ids a sequence may not draw next (`ahead` tokens later): its stop tokens
        (and EOS, unless it ignores EOS) while it has fewer than `min_tokens` outputs."""
        p = seq.params
        if seq.num_output_tokens + ahead >= p.min_tokens:
            return ()
        eos = () if p.ignore_eos else tuple(self.eos_token_ids)
        return tuple(dict.fromkeys((*p.stop_token_ids, *eos)))

    def _fork(self, parent: Sequence, sibling: int) -> Sequence:
        child = self._pending_children.pop((parent.seq_id, sibling))
        self.kv.fork(parent, child)
        self.scheduler.add_running(child)
        return child

    # ---- speculative decoding ---------------------------------------------------------------

    def _verify(
        self, seqs: list[Sequence], logits: list[torch.Tensor], out: StepOutput
    ) -> list[str]:
        """Each drafted sequence's rows [1 + drafts, V] against its drafts (module docstring);
        its drafts are gone afterwards, whatever happened. The greedy sequences' rows are
        drawn together first (they need no generator: one sampler pass, one copy from a
        device); a sampled row only once the walk reaches it (seeded for its position as a
        decode there would be), so rows after a rejection are never drawn."""
        assert out.columns is None  # drafts are token ids: the real model's logits only
        drafts = [seq.draft_tokens for seq in seqs]
        for seq in seqs:
            seq.draft_tokens = []
        greedy = self._greedy_draws(seqs, drafts, logits, out)
        touched: list[str] = []
        for i, (seq, rows) in enumerate(zip(seqs, logits, strict=True)):
            if seq.request_id in self.failed or seq.is_finished:
                continue
            touched.append(seq.request_id)
            with self._blame(seq.request_id):
                draws = greedy[i] if i in greedy else self._sampled_draws(seq, drafts[i], rows, out)
                self.spec_decode.record(len(drafts[i]), self._accept(seq, drafts[i], draws))
        return touched

    def _greedy_draws(
        self,
        seqs: list[Sequence],
        drafts: list[list[int]],
        logits: list[torch.Tensor],
        out: StepOutput,
    ) -> dict[int, Iterator[Draw]]:
        """Every row of each greedy sequence (by its index in `seqs`), drawn in one pass;
        a sequence whose request failed in it is left out."""
        picked = [
            i for i, q in enumerate(seqs) if q.params.greedy and q.request_id not in self.failed
        ]
        if not picked:
            return {}
        rows: list[SampleRow] = []
        owners: list[str] = []
        for i in picked:
            seq = seqs[i]
            for j, draft in enumerate([*drafts[i], None]):  # the last row: the bonus token's
                rows.append(SampleRow(seq.params, None, self._suppressed(seq, j), draft))
                owners.append(seq.request_id)
        drawn = self._draw(torch.cat([logits[i] for i in picked]), rows, owners, out)
        draws: dict[int, Iterator[Draw]] = {}
        at = 0
        for i in picked:
            mine = drawn[at : at + len(drafts[i]) + 1]
            at += len(mine)
            if all(d is not None for d in mine):
                draws[i] = iter([d for d in mine if d is not None])
        return draws

    def _sampled_draws(
        self, seq: Sequence, drafts: list[int], rows: torch.Tensor, out: StepOutput
    ) -> Iterator[Draw]:
        """Row j's draw, taken once rows 0..j-1 are appended (so that its seed and its
        min_tokens suppression are those of its position)."""
        for j, draft in enumerate([*drafts, None]):
            row = dataclasses.replace(self._sample_row(seq, -1), draft=draft)
            (drawn,) = self._draw_rows(rows[j : j + 1], [row], out)
            assert drawn is not None
            yield drawn

    def _accept(self, seq: Sequence, drafts: list[int], draws: Iterator[Draw]) -> int:
        """Append row after row's token while each is the draft it verifies; how many drafts
        were accepted."""
        accepted = 0
        for j, (token, logprob, top) in enumerate(draws):
            self._append(seq, token, logprob, top)
            if j == len(drafts) or token != drafts[j]:
                break
            accepted += 1
            if seq.is_finished:
                break
            seq.num_computed_tokens += 1  # the draft's K/V (this step's) is the token's
            self.kv.publish(seq)
        return accepted

    # ---- beam search ------------------------------------------------------------------------

    def _beam_step(self, seqs: list[Sequence], logits: torch.Tensor) -> list[str]:
        """Stash each beam's log-softmax row (logits [len(seqs), V]); advance every beam
        request whose live beams all have theirs. Returns the requests whose search
        finished."""
        logprobs = torch.log_softmax(logits, dim=-1)
        ready: dict[str, Request] = {}
        for seq, row in zip(seqs, logprobs, strict=True):
            req = self.requests[seq.request_id]
            assert req.beam is not None
            with self._blame(req.request_id):
                if req.beam.stash(seq, row):
                    ready[req.request_id] = req
        done = []
        for rid, req in ready.items():
            assert req.beam is not None
            if rid in self.failed:
                continue
            with self._blame(rid):
                inject_request_fault(req.params)
                if req.beam.advance(self._fork_beam, self._drop_beam):
                    self._finish_beam_request(req)
                    done.append(rid)
        return done

    def _fork_beam(self, parent: Sequence) -> Sequence:
        child = self.factory.beam(parent)
        self.kv.fork(parent, child)
        self.scheduler.add_running(child)
        return child

    def _drop_beam(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, FinishReason.ABORT)

    def _finish_beam_request(self, req: Request) -> None:
        """The best hypothesis becomes completion 0."""
        assert req.beam is not None
        best = req.beam.search.best()
        comp = req.completions[0]
        result = Sequence(
            seq_id=comp.seq.seq_id,
            request_id=req.request_id,
            index=0,
            token_ids=req.prompt + list(best.token_ids),
            num_prompt_tokens=len(req.prompt),
            params=req.params,
            arrival=comp.seq.arrival,
            num_cached_tokens=comp.seq.num_cached_tokens,
            cached_tokens_by_source=dict(comp.seq.cached_tokens_by_source),
            store_lookup=comp.seq.store_lookup,
        )
        result.status = SequenceStatus.FINISHED
        ends_in_eos = bool(best.token_ids) and best.token_ids[-1] in req.beam.search.eos
        result.finish_reason = FinishReason.STOP if ends_in_eos else FinishReason.LENGTH
        comp.seq = result
        for tok in best.token_ids:
            comp.add(tok)

    # ---- tokens out -------------------------------------------------------------------------

    def _append(
        self, seq: Sequence, token: int, logprob: float, top: dict[int, float] | None = None
    ) -> None:
        inject_request_fault(seq.params)
        seq.token_ids.append(token)
        if seq.params.logprobs:
            seq.logprobs.append(logprob)
            if seq.params.top_logprobs:
                seq.top_logprobs.append(top or {})
        seq.cumulative_logprob += logprob
        req = self.requests[seq.request_id]
        comp = req.completions[seq.index]
        if self._defer and not seq.params.stop:
            self._untexted.append((comp, token))
        else:
            comp.add(token)
        reason = self._stop_reason(seq, comp, token)
        if reason is not None:
            if req.export_tail and seq.index == 0:
                req.kv_tail = self.kv.tail_of(seq)
            self.scheduler.finish(seq, reason)

    def _stop_reason(self, seq: Sequence, comp: Completion, token: int) -> FinishReason | None:
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:  # nothing but the length ends it yet
            return FinishReason.LENGTH if seq.num_tokens >= self.max_model_len else None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if p.stop and comp.cut_at_stop(p.stop):
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _output(self, req: Request) -> RequestOutput:
        finished = req.finished
        hold = max((len(s) for s in req.params.stop), default=1) - 1
        deltas = [req.completions[idx].delta(idx, hold) for idx in sorted(req.completions)]
        first = req.completions[0].seq
        if finished:
            del self.requests[req.request_id]
        return RequestOutput(
            req.request_id,
            req.prompt,
            first.num_cached_tokens,
            deltas,
            finished,
            kv_tail=req.kv_tail if finished else None,
            cached_tokens_by_source=dict(first.cached_tokens_by_source),
            store_lookup=first.store_lookup,
        )
