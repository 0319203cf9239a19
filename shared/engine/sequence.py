"""A Sequence: token ids, how many of them are in the KV cache, its block table, its state.

There is no prefill or decode phase: each step the scheduler lets `num_computed_tokens` catch up
with `num_tokens`; a prompt chunk, a prefix hit and a decode token are the same path.
Owned by the Scheduler; the Engine appends sampled tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

import torch
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.hashing import BlockHash, block_hashes

if TYPE_CHECKING:
    from kvserve.shared.store.block_data import KVTail

SeqId = NewType("SeqId", int)
BlockId = NewType("BlockId", int)


class SequenceStatus(enum.Enum):
    FETCHING = "fetching"  # waiting, parked until its prefix blocks arrive from the store
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    seq_id: SeqId
    request_id: str
    index: int  # which of the request's n completions (or beams) this is
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int  # admission order; the newest running sequence is preempted first
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[BlockId] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    # Siblings of n > 1 wait for the parent's prompt; they are forked when it is computed.
    pending_forks: int = 0
    # Prefix caching: the root (model, tokenizer, KV format, block size, salt) and the chained
    # hashes of the full blocks known so far; blocks [0, num_published) are in the index.
    root_hash: BlockHash | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_published: int = 0
    # Where the prefix blocks attached at the first admission came from, in tokens (they sum
    # to num_cached_tokens): "device" (the engine's cache), "host" (host-RAM tier), "store"
    # (fetched from the store).
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    # How the store lookup for the prompt's prefix ended (tiers.LOOKUP_OUTCOMES); None when
    # the store was not asked (no store, or the device cache and host tier held the prefix).
    store_lookup: str | None = None
    # Blocks a store load wrote straight into the device cache for this sequence, until its
    # first admission counts them as "store" tokens.
    loaded_from_store: set[BlockHash] = field(default_factory=set)
    # Disaggregated decode: the prompt's partial last block as the prefill worker computed it,
    # attached at first admission when every full block before it is cached (then dropped).
    kv_tail: KVTail | None = None
    # Speculative decoding: tokens proposed to follow token_ids, set by the scheduler for the
    # step it schedules them in and cleared once that step's logits have verified them. Never
    # part of token_ids, so no hash, stop check or output sees them; their KV slots count as
    # computed only for those verification accepts (Scheduler.advance, OutputProcessor).
    draft_tokens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def full_block_hashes(self, num_blocks: int, block_size: int) -> list[BlockHash]:
        """Hashes of the first `num_blocks` full blocks (computed once, extended lazily)."""
        assert self.root_hash is not None
        have = len(self.block_hashes)
        if num_blocks > have:
            parent = self.block_hashes[-1] if have else None
            self.block_hashes += block_hashes(
                self.root_hash, self.token_ids[: num_blocks * block_size], block_size, have, parent
            )
        return self.block_hashes[:num_blocks]

    def matchable_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hashes of the full blocks before the last token: the most a prefix match can
        attach, since the last token is always computed (its logits are needed)."""
        return self.full_block_hashes((self.num_tokens - 1) // block_size, block_size)

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Blocks the table must hold to cover `num_tokens` tokens, beyond those it has."""
        return max(0, -(-num_tokens // block_size) - len(self.block_table))
