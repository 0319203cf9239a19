"""PrefixIndex: a radix tree over chained block hashes, mapping cached full blocks to block ids.

Each node is one full block; its parent is the block before it in the sequence, so a path from
the root spells a cached token prefix. Because block hashes are chained, `match` walks a
request's hashes with one dict lookup per block and stops at the first miss.

Invariants:
- a node's block holds exactly the KV of the tokens its hash chain names;
- a block is in the index at most once, and a hash maps to at most one block;
- `evictable` nodes are those whose block has no reference (the BlockPool tells us through
  `release` / `acquire`); only evictable *leaves* are evicted, least recently used first, so a
  shared system prompt (an inner node) outlives the unique suffixes that hang off it;
- a node is inserted only under its own sequence's previous block, and holders reference whole
  chains, so a referenced node's ancestors are referenced: every evictable subtree has an
  evictable leaf, and `evict(num_evictable)` always succeeds.
Access times come from a counter, not the clock, so eviction order is deterministic.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from kvserve.shared.engine.sequence import BlockId
from kvserve.shared.store.hashing import BlockHash


@dataclass(eq=False)
class _Node:
    hash: BlockHash | None
    block: BlockId | None
    parent: _Node | None
    children: dict[BlockHash, _Node] = field(default_factory=dict)
    last_access: int = 0
    evictable: bool = False


class PrefixIndex:
    def __init__(self) -> None:
        self._root = _Node(None, None, None)
        self._by_hash: dict[BlockHash, _Node] = {}
        self._by_block: dict[BlockId, _Node] = {}
        self._clock = 0
        self.num_evictable = 0
        # Candidate evictable leaves (last_access, block, node); entries go stale when a node is
        # acquired, touched, gains a child or is removed, and are checked when popped.
        self._leaves: list[tuple[int, int, _Node]] = []

    def __len__(self) -> int:
        return len(self._by_hash)

    def hashes(self) -> list[BlockHash]:
        """Every cached block's hash."""
        return list(self._by_hash)

    def __contains__(self, block: BlockId) -> bool:
        return block in self._by_block

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def block_of(self, h: BlockHash) -> BlockId | None:
        node = self._by_hash.get(h)
        return None if node is None else node.block

    def match(self, hashes: list[BlockHash]) -> list[BlockId]:
        """Blocks of the longest cached prefix of `hashes` (touched as used now)."""
        now = self._tick()
        blocks: list[BlockId] = []
        node = self._root
        for h in hashes:
            child = node.children.get(h)
            if child is None:
                break
            child.last_access = now
            if child.evictable:  # its heap entry went stale with the touch: a fresh one
                self._push_if_leaf(child)
            assert child.block is not None
            blocks.append(child.block)
            node = child
        return blocks

    def insert(self, parent: BlockId | None, h: BlockHash, block: BlockId) -> bool:
        """Cache `block` (referenced, fully computed) as hash `h` under `parent`, the block
        before it in the same sequence (None for the first block). False, changing nothing,
        when `h` is already cached (another sequence computed the same block) or `parent` is
        not cached."""
        if h in self._by_hash or block in self._by_block:
            return False
        pnode = self._root if parent is None else self._by_block.get(parent)
        if pnode is None:
            return False
        node = _Node(h, block, pnode, last_access=self._tick())
        pnode.children[h] = node  # pnode's heap entry (if any) goes stale: it has a child
        self._by_hash[h] = node
        self._by_block[block] = node
        return True

    def release(self, block: BlockId) -> None:
        """The block's last reference is gone: it may be evicted from now on."""
        node = self._by_block[block]
        node.evictable = True
        node.last_access = self._tick()
        self.num_evictable += 1
        self._push_if_leaf(node)

    def _push_if_leaf(self, node: _Node) -> None:
        if node.evictable and not node.children and node.block is not None:
            heapq.heappush(self._leaves, (node.last_access, node.block, node))
            if len(self._leaves) > 4 * (self.num_evictable + 64):  # drop stale entries
                self._leaves = [e for e in self._leaves if self._is_live(e)]
                heapq.heapify(self._leaves)

    def _is_live(self, entry: tuple[int, int, _Node]) -> bool:
        t, b, node = entry
        return (
            node.evictable
            and not node.children
            and node.last_access == t
            and self._by_block.get(BlockId(b)) is node
        )

    def acquire(self, block: BlockId) -> None:
        """An evictable block is referenced again (a prefix hit)."""
        node = self._by_block[block]
        if node.evictable:
            node.evictable = False
            self.num_evictable -= 1

    def is_evictable(self, block: BlockId) -> bool:
        node = self._by_block.get(block)
        return node is not None and node.evictable

    def eviction_order(self) -> list[BlockId]:
        """All evictable blocks in the order `evict` would take them (a full scan; for tests
        and introspection, not the hot path)."""
        return self._evict(self.num_evictable, dry_run=True)

    def evict(self, n: int) -> list[tuple[BlockId, BlockHash]]:
        """Remove `n` evictable blocks, least recently used leaf first; returns (block id,
        hash) of each. Amortised O(log N) per block: evictable leaves live in a heap with lazy
        deletion."""
        if n > self.num_evictable:
            raise ValueError(f"cannot evict {n} blocks, {self.num_evictable} evictable")
        out: list[tuple[BlockId, BlockHash]] = []
        while len(out) < n:
            entry = heapq.heappop(self._leaves)
            if not self._is_live(entry):
                continue
            node = entry[2]
            assert node.block is not None and node.parent is not None and node.hash is not None
            out.append((node.block, node.hash))
            parent = node.parent
            self._remove(node)
            self._push_if_leaf(parent)
        return out

    def _evict(self, n: int, dry_run: bool) -> list[BlockId]:
        if n > self.num_evictable:
            raise ValueError(f"cannot evict {n} blocks, {self.num_evictable} evictable")
        gone: set[int] = set()

        def is_leaf(node: _Node) -> bool:
            return all(id(c) in gone for c in node.children.values())

        heap = [
            (node.last_access, node.block, node)
            for node in self._by_block.values()
            if node.evictable and is_leaf(node)
        ]
        heapq.heapify(heap)
        out: list[BlockId] = []
        while len(out) < n:
            _, _, node = heapq.heappop(heap)
            assert node.block is not None and node.hash is not None and node.parent is not None
            out.append(node.block)
            gone.add(id(node))
            parent = node.parent
            if not dry_run:
                self._remove(node)
            if parent.evictable and is_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.block, parent))
        return out

    def _remove(self, node: _Node) -> None:
        assert node.parent is not None and node.hash is not None and node.block is not None
        del node.parent.children[node.hash]
        del self._by_hash[node.hash]
        del self._by_block[node.block]
        if node.evictable:
            self.num_evictable -= 1
