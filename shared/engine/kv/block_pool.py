"""BlockPool: block ids, reference counts and the free list. No tensors.

Invariants (checked by `check()` and a hypothesis state machine in the tests):
- every block id in [0, num_blocks) is either free (reference count 0, in `_free`) or used
  (reference count > 0, not in `_free`); free + used == num_blocks;
- `_free` is in LRU order: `allocate` takes from the front, `free` appends to the back, so the
  block released longest ago is reused first;
- a block shared by several sequences (n > 1 siblings, beams, a common prefix) has one reference
  per holder; a holder that must write into a shared block forks it first (copy-on-write).
- with prefix caching, a free block that holds a cached full block is not in `_free` but
  evictable in the PrefixIndex; `allocate` takes plain free blocks first, then evicts cached
  ones (least recently used leaf first). free = plain free + evictable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvserve.shared.engine.kv.prefix_index import PrefixIndex
from kvserve.shared.engine.sequence import BlockId
from kvserve.shared.store.hashing import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[BlockId, None] = OrderedDict(
            (BlockId(b), None) for b in range(num_blocks)
        )
        self.index: PrefixIndex | None = PrefixIndex() if enable_caching else None
        self.num_evicted = 0
        # (block id, hash) of cached blocks `allocate` evicted, until `take_evicted`.
        self._evicted: list[tuple[BlockId, BlockHash]] = []

    @property
    def num_free(self) -> int:
        return len(self._free) + (self.index.num_evictable if self.index else 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def free_block_ids(self) -> list[BlockId]:
        """Free blocks in the order `allocate` would take them."""
        cached = self.index.eviction_order() if self.index else []
        return list(self._free) + cached

    def allocate(self, n: int) -> list[BlockId] | None:
        """Take `n` free blocks (reference count 1 each), or None, changing nothing, if fewer
        than `n` are free. Plain free blocks go first; then cached blocks are evicted (their
        ids and hashes wait in `take_evicted` for the caller, who may still read them)."""
        if n > self.num_free:
            return None
        blocks = [self._free.popitem(last=False)[0] for _ in range(min(n, len(self._free)))]
        if len(blocks) < n:
            assert self.index is not None
            evicted = self.index.evict(n - len(blocks))
            self.num_evicted += len(evicted)
            self._evicted += evicted
            blocks += [b for b, _ in evicted]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def take_evicted(self) -> list[tuple[BlockId, BlockHash]]:
        """The cached blocks evicted since the last call, as (block id, hash)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    # ---- prefix caching -------------------------------------------------------------------

    def cache(self, parent: BlockId | None, h: BlockHash, block: BlockId) -> bool:
        """Publish a referenced, fully computed block under hash `h`; `parent` is the block
        before it in the same block table. False if not cached (caching off, hash already
        cached by another block, or parent not cached)."""
        if self.index is None or self.ref_counts[block] < 1:
            return False
        return self.index.insert(parent, h, block)

    def match_prefix(self, hashes: list[BlockHash]) -> list[BlockId]:
        """Take a reference on each block of the longest cached prefix of `hashes`."""
        if self.index is None:
            return []
        blocks = self.index.match(hashes)
        for b in blocks:
            if self.ref_counts[b] == 0:
                self.index.acquire(b)
            self.ref_counts[b] += 1
        return blocks

    def drop_cached(self) -> list[tuple[BlockId, BlockHash]]:
        """Forget every evictable cached block (not reported by `take_evicted`); they become
        plain free blocks. Cached blocks that requests hold stay. Returns the dropped ones."""
        if self.index is None:
            return []
        dropped: list[tuple[BlockId, BlockHash]] = []
        while self.index.num_evictable:
            try:
                evicted = self.index.evict(1)
            except (IndexError, ValueError):  # only blocks under a held child are left
                break
            for b, _ in evicted:
                self._free[b] = None
            dropped += evicted
        return dropped

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
                if self.index is not None and b in self.index:
                    self.index.release(b)
                else:
                    self._free[b] = None

    def is_shared(self, block: BlockId) -> bool:
        return self.ref_counts[block] > 1

    def check(self) -> None:
        """Assert the invariants (tests and debugging)."""
        for b in range(self.num_blocks):
            rc = self.ref_counts[b]
            assert rc >= 0, f"negative reference count on block {b}"
            in_free = BlockId(b) in self._free
            evictable = self.index is not None and self.index.is_evictable(BlockId(b))
            assert not (in_free and evictable), f"block {b} both plain free and cached"
            assert (rc == 0) == (in_free or evictable), f"block {b}: free list disagrees"
