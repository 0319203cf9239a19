"""Request: one request in the engine's table (its prompt, parameters, completions and beam
group), and SequenceFactory, which makes every Sequence the engine runs.

Invariants: sequence ids and arrival numbers come from one factory per engine, so they are
unique and increasing (the scheduler preempts the newest arrival first); every sequence of a
completion is registered in its request's `completions` with a fresh detokenizer.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import torch
from kvserve.shared.engine.beam_search import BeamGroup
from kvserve.shared.engine.outputs import Completion
from kvserve.shared.engine.sequence import SeqId, Sequence
from kvserve.shared.model.tokenizer import IncrementalDetokenizer, KVTokenizer
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.block_data import KVTail
from kvserve.shared.store.hashing import BlockHash


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    root_hash: BlockHash | None = None
    completions: dict[int, Completion] = field(default_factory=dict)
    beam: BeamGroup | None = None
    export_tail: bool = False
    kv_tail: KVTail | None = None
    # The sampling seed: the client's, or one drawn here (every token is drawn with its own
    # generator seed derived from it: sampler.position_seed).
    seed: int = field(default_factory=lambda: random.getrandbits(62))

    @property
    def finished(self) -> bool:
        return len(self.completions) == self.params.n and all(
            c.seq.is_finished for c in self.completions.values()
        )


class SequenceFactory:
    def __init__(self, tokenizer: KVTokenizer) -> None:
        self.tokenizer = tokenizer
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    def next_id(self) -> int:
        """A fresh number (also used for request ids the engine makes itself)."""
        return next(self._seq_ids)

    def completion(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        """Completion `index` of `req` starting from `token_ids`, registered in the request."""
        params = req.params
        seq = Sequence(
            seq_id=SeqId(next(self._seq_ids)),
            request_id=req.request_id,
            index=index,
            token_ids=list(token_ids),
            num_prompt_tokens=len(req.prompt),
            params=params,
            arrival=next(self._arrivals),
            generator=None if params.greedy else torch.Generator(),
            root_hash=req.root_hash,
        )
        req.completions[index] = Completion(
            seq, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        )
        return seq

    def beam(self, parent: Sequence) -> Sequence:
        """A new beam continuing `parent` (its blocks are shared by the caller)."""
        return Sequence(
            seq_id=SeqId(next(self._seq_ids)),
            request_id=parent.request_id,
            index=0,
            token_ids=list(parent.token_ids),
            num_prompt_tokens=parent.num_prompt_tokens,
            params=parent.params,
            arrival=next(self._arrivals),
            root_hash=parent.root_hash,
        )
