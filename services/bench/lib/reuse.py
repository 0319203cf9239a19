"""What a perfect prefix cache could have served: `ReuseTracker`, a benchmark statistic of
`kvserve bench serve`.

A request's reusable tokens are the longest prefix of its prompt, in whole blocks of
`block_size` tokens, that it shares with the token sequence of an earlier request: that
request's prompt, or its prompt followed by its output (the history a multi-round conversation
sends next). The last prompt token never counts: an engine always computes it to sample the
first output token, so at most (len - 1) // block_size * block_size tokens are reusable.

Blocks are identified as a prefix cache does, by chained hashes: a block's key is the hash of
(its parent's key, its tokens), so equal keys mean equal prefixes up to that block. Python's
tuple hash is enough here (a statistic, not a cache key: a collision costs a miscount, never a
wrong answer).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

DEFAULT_BLOCK_SIZE = 16
_ROOT = 0  # the parent key of a sequence's first block


class ReuseTracker:
    """The set of block keys of every sequence seen so far; it only grows. Feed it in the order
    a server would see them: `observe(prompt)` when a request is sent, `add(prompt + output)`
    when it finishes."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._keys: set[int] = set()

    def _block_keys(self, tokens: Sequence[int], n_blocks: int) -> Iterator[int]:
        key, bs = _ROOT, self.block_size
        for b in range(n_blocks):
            key = hash((key, tuple(tokens[b * bs : (b + 1) * bs])))
            yield key

    def reusable(self, prompt: Sequence[int]) -> int:
        """Tokens of `prompt` an earlier sequence's blocks cover (whole blocks, never the last
        token)."""
        n = 0
        for key in self._block_keys(prompt, (len(prompt) - 1) // self.block_size):
            if key not in self._keys:
                break
            n += self.block_size
        return n

    def add(self, tokens: Sequence[int]) -> None:
        """Remember the whole blocks of `tokens` (a partial last block is not cacheable)."""
        self._keys.update(self._block_keys(tokens, len(tokens) // self.block_size))

    def observe(self, prompt: Sequence[int]) -> int:
        """`reusable(prompt)`, then `add(prompt)`: a request being sent."""
        n = self.reusable(prompt)
        self.add(prompt)
        return n
