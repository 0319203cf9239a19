"""BlockPool: block ids, reference counts and the free list. No tensors.

Invariants (checked by `check()` and a hypothesis state machine in the tests):
- every block id in [0, num_blocks) is either free (reference count 0, in `_free`) or used
  (reference count > 0, not in `_free`); free + used == num_blocks;
- `_free` is in LRU order: `allocate` takes from the front, `free` appends to the back, so the
  block released longest ago is reused first;
- a block shared by several sequences (n > 1 siblings, beams, a common prefix) has one reference
  per holder; a holder that must write into a shared block forks it first (copy-on-write).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvserve.shared.engine.sequence import BlockId


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[BlockId, None] = OrderedDict(
            (BlockId(b), None) for b in range(num_blocks)
        )

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def free_block_ids(self) -> list[BlockId]:
        """Free blocks in the order `allocate` would take them."""
        return list(self._free)

    def allocate(self, n: int) -> list[BlockId] | None:
        """Take `n` free blocks (reference count 1 each), or None, changing nothing, if fewer
        than `n` are free."""
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def share(self, blocks: Iterable[BlockId]) -> None:
        """Add one reference to each (used) block: a new holder shares it."""
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
            self.ref_counts[b] += 1

    def free(self, blocks: Iterable[BlockId]) -> None:
        """Drop one reference from each block; a block with none left goes to the back of the
        free list. Pass a table's blocks last-first so its tail is reused before its head."""
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise ValueError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def is_shared(self, block: BlockId) -> bool:
        return self.ref_counts[block] > 1

    def check(self) -> None:
        """Assert the invariants (tests and debugging)."""
        for b in range(self.num_blocks):
            rc = self.ref_counts[b]
            assert rc >= 0, f"negative reference count on block {b}"
            assert (rc == 0) == (BlockId(b) in self._free), f"block {b}: free list disagrees"
