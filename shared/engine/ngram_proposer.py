"""NgramProposer: draft tokens for speculative decoding by n-gram lookup (prompt lookup, vLLM's
`ngram` method), no draft model.

For a sequence in the decode state: the latest earlier occurrence of its last n tokens among its
own token ids (prompt and output), for n from `prompt_lookup_max` down to `prompt_lookup_min`
(the longest n that occurs wins), and the up-to-K tokens that followed that occurrence. When the
occurrence ends less than K tokens before the end of the sequence, the tokens after it run into
the suffix itself, and the copy goes on over its own output as an LZ77 copy does (after
"x a b a b" the match "a b" at 1 proposes "a b a b ..."): a short loop still gets K drafts.

Cost: each sequence's token ids are mirrored as a byte string (uint32 per token) that is
extended by the tokens appended since the last lookup (a Sequence's token ids only grow, at the
end), and each n is one `bytearray.rfind` over it (C, memchr-based): a few microseconds for a
few thousand tokens, with no window that would miss a passage far back in a long prompt. The
mirrors belong to the proposer, weakly keyed by their sequence (they go when it goes).

Which sequences draft: one completion sampled token by token: not beam search (its beams
advance together), not n > 1 (its siblings fork from the parent's blocks).
"""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Sequence as Seq

from kvserve.shared.config import SpeculativeConfig
from kvserve.shared.engine.sequence import Sequence
from kvserve.shared.sampling_params import SamplingParams

TOKEN = "I"  # the mirror's element: uint32, 4 bytes
WIDTH = array(TOKEN).itemsize
assert WIDTH == 4


def lookup(buf: bytes | bytearray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` draft tokens for the token ids mirrored in `buf` (WIDTH bytes each): those
    after the latest earlier occurrence of the longest suffix of n_max .. n_min tokens that
    occurs earlier; [] when none does."""
    num_tokens = len(buf) // WIDTH
    for n in range(min(n_max, num_tokens - 1), n_min - 1, -1):
        pattern = bytes(buf[-n * WIDTH :])
        end = len(buf) - WIDTH  # an occurrence ends before the last token
        while (at := buf.rfind(pattern, 0, end)) >= 0:
            if at % WIDTH == 0:
                return _follow(buf, at // WIDTH + n, k)
            end = at + len(pattern) - 1  # a hit across token boundaries: look further left
    return []


def _follow(buf: bytes | bytearray, start: int, k: int) -> list[int]:
    """`k` tokens from token `start` on, continuing over the copy itself past the end."""
    num_tokens = len(buf) // WIDTH
    out = array(TOKEN, buf[start * WIDTH : min(num_tokens, start + k) * WIDTH]).tolist()
    period = num_tokens - start
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


def propose(token_ids: Seq[int], k: int, n_min: int, n_max: int) -> list[int]:
    """`lookup` on a list of token ids."""
    return lookup(array(TOKEN, token_ids).tobytes(), k, n_min, n_max)


def drafts_for(params: SamplingParams) -> bool:
    """Whether a sequence of these params may carry drafts."""
    return params.n == 1 and params.beam_width == 1


class NgramProposer:
    """Draft tokens for the scheduler (its Drafter); keeps each sequence's mirror (see the
    module docstring), nothing else."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_min = config.prompt_lookup_min
        self.n_max = config.prompt_lookup_max
        self._mirrors: weakref.WeakKeyDictionary[Sequence, bytearray] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """At most `limit` drafts to follow `seq`'s tokens, and never more than its
        max_tokens leave room for beside the token its verification appends anyway."""
        k = min(self.k, limit, seq.params.max_tokens - seq.num_output_tokens - 1)
        if k <= 0 or not drafts_for(seq.params):
            return []
        return lookup(self._mirror(seq), k, self.n_min, self.n_max)

    def _mirror(self, seq: Sequence) -> bytearray:
        """`seq`'s token ids as bytes, extended by those appended since the last call."""
        buf = self._mirrors.get(seq)
        have = len(buf) // WIDTH if buf is not None else 0
        if buf is None or have > seq.num_tokens:
            buf = self._mirrors[seq] = bytearray(array(TOKEN, seq.token_ids).tobytes())
        elif have < seq.num_tokens:
            buf += array(TOKEN, seq.token_ids[have:]).tobytes()
        return buf
