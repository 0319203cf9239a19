"""Beam search with Hugging Face's semantics (transformers' `_beam_search`, batch size 1).

Each step: add every live beam's log-softmax row to its score, take the top
K = max(2, 1 + #eos) * width candidates; candidates ending in EOS (or reaching max length)
among the first `width` become finished hypotheses scored `score / gen_len ** length_penalty`;
the best `width` unfinished candidates are the next live beams. The search stops when no live
beam can beat the worst kept hypothesis (HF's heuristic), when all hypotheses are in and
`early_stopping` is True, or when every candidate hits a stopping criterion.

`BeamSearch` holds only scores and token lists. `BeamGroup` maps its beams to Sequences, which
share their common blocks copy-on-write and fork on divergence; the Engine gives it the two
operations that touch blocks and the scheduler (fork a sequence, drop one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from kvserve.shared.engine.sequence import SeqId, Sequence

_NEG = -1.0e9


@dataclass(frozen=True)
class Candidate:
    parent: int  # index of the live beam it extends
    token: int
    score: float  # cumulative log-probability


@dataclass(frozen=True)
class Hypothesis:
    score: float  # length-penalised
    token_ids: tuple[int, ...]  # generated tokens, including the final EOS if any
    finished: bool


class BeamSearch:
    def __init__(
        self,
        width: int,
        max_new_tokens: int,
        eos_token_ids: set[int],
        length_penalty: float = 1.0,
        early_stopping: bool = False,
    ) -> None:
        self.width = width
        self.max_new_tokens = max_new_tokens
        self.eos = eos_token_ids
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_candidates = max(2, 1 + len(eos_token_ids)) * width
        # Live beams: generated tokens and cumulative scores (one beam at the start).
        self.beams: list[list[int]] = [[]]
        self.scores: list[float] = [0.0]
        # Kept hypotheses, always `width` of them, best first (placeholders unfinished).
        self.hyps = [Hypothesis(_NEG, (), False) for _ in range(width)]
        self._improvable = True
        self.done = False

    def step(self, logprobs: torch.Tensor) -> list[Candidate]:
        """logprobs [num_live_beams, vocab] (log-softmax rows, float32) -> the next live beams,
        best first, as (parent, token, score). Sets `done` when the search is over."""
        gen_len = len(self.beams[0]) + 1  # generated length after this step
        scores = torch.tensor(self.scores, device=logprobs.device)
        total = logprobs + scores[:, None]  # [B, V]
        vocab = total.shape[1]
        k = min(self.num_candidates, total.numel())
        top_scores, top_idx = torch.topk(total.flatten(), k)
        cands = [
            Candidate(int(i) // vocab, int(i) % vocab, float(s))
            for s, i in zip(top_scores.tolist(), top_idx.tolist(), strict=True)
        ]
        at_max = gen_len >= self.max_new_tokens
        hits = [at_max or c.token in self.eos for c in cands]
        self._update_hypotheses(cands, hits, gen_len)
        running = sorted(
            range(len(cands)),
            key=lambda j: cands[j].score + (_NEG if hits[j] else 0.0),
            reverse=True,
        )[: self.width]
        nxt = [cands[j] for j in running]
        next_scores = [
            c.score + (_NEG if hits[j] else 0.0) for j, c in zip(running, nxt, strict=True)
        ]
        self.beams = [[*self.beams[c.parent], c.token] for c in nxt]
        self.scores = next_scores
        self._check_stop(gen_len, hits)
        return nxt

    def _update_hypotheses(self, cands: list[Candidate], hits: list[bool], gen_len: int) -> None:
        all_in = all(h.finished for h in self.hyps)
        blocked = (all_in and self.early_stopping) or not self._improvable
        merged = list(self.hyps)
        for j, (c, hit) in enumerate(zip(cands, hits, strict=True)):
            if not hit or j >= self.width or blocked:
                continue
            score = c.score / (gen_len**self.length_penalty)
            merged.append(Hypothesis(score, (*self.beams[c.parent], c.token), True))
        # Stable sort: among equal scores, earlier entries (kept ones) win, as torch.topk does.
        merged.sort(key=lambda h: h.score, reverse=True)
        self.hyps = merged[: self.width]

    def _check_stop(self, gen_len: int, hits: list[bool]) -> None:
        best_running = self.scores[0] / (gen_len**self.length_penalty)
        if all(h.finished for h in self.hyps):
            worst = min(h.score for h in self.hyps)
            self._improvable = self._improvable and best_running > worst
        all_in = all(h.finished for h in self.hyps)
        self.done = not self._improvable or (all_in and self.early_stopping) or all(hits)

    def best(self) -> Hypothesis:
        return self.hyps[0]


@dataclass
class BeamGroup:
    """The live beams of one beam-search request as Sequences, in beam order.

    Each step every live beam's log-softmax row is stashed (`stash`); a preempted beam makes
    its siblings wait, computed, for its row. When all rows are in, `advance` runs one search
    step: a parent chosen by several candidates is forked for all but the first (blocks shared
    until a beam writes), unchosen beams are dropped, and every kept beam appends its token.
    """

    search: BeamSearch
    seqs: list[Sequence]
    rows: dict[SeqId, torch.Tensor] = field(default_factory=dict)

    def stash(self, seq: Sequence, row: torch.Tensor) -> bool:
        """Keep the beam's row for this step; True when every live beam has one."""
        self.rows[seq.seq_id] = row
        return len(self.rows) == len(self.seqs)

    def advance(
        self, fork: Callable[[Sequence], Sequence], drop: Callable[[Sequence], None]
    ) -> bool:
        """One search step over the stashed rows; True when the search is over (every live
        beam dropped; `search.best()` is the answer)."""
        rows = torch.stack([self.rows.pop(s.seq_id) for s in self.seqs])
        cands = self.search.step(rows)
        if self.search.done:
            for seq in self.seqs:
                drop(seq)
            self.seqs = []
            return True
        chosen: list[Sequence] = []
        taken: set[int] = set()
        for c in cands:  # fork before any parent appends its token
            if c.parent in taken:
                chosen.append(fork(self.seqs[c.parent]))
            else:
                taken.add(c.parent)
                chosen.append(self.seqs[c.parent])
        for i, seq in enumerate(self.seqs):
            if i not in taken:
                drop(seq)
        for seq, c in zip(chosen, cands, strict=True):
            seq.token_ids.append(c.token)
            seq.cumulative_logprob = c.score
        self.seqs = chosen
        return False
