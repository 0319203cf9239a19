"""HostTier: blocks evicted from the device cache, kept in host RAM.

Invariants (one thread, the engine's, uses it):
- it maps a block hash to that block's BlockData (the cache's own representation, so moving a
  block back into the cache is a copy, exact), bounded by bytes, least recently used out first;
- pinned entries (warm-up prefixes) are kept outside the byte bound and never evicted;
- each entry remembers where it came from (`"host"`: evicted from the device cache or pinned by
  a warm-up), so cached tokens can be counted by source.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvserve.shared.store.block_data import BlockData
from kvserve.shared.store.hashing import BlockHash


@dataclass
class _HostEntry:
    data: BlockData
    source: str


class HostTier:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[BlockHash, _HostEntry] = OrderedDict()
        self._pinned: dict[BlockHash, _HostEntry] = {}  # warm-up blocks: never evicted
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries) + len(self._pinned)

    def __contains__(self, h: BlockHash) -> bool:
        return h in self._entries or h in self._pinned

    def hashes(self) -> list[BlockHash]:
        return [*self._entries, *self._pinned]

    def pin(self, h: BlockHash, data: BlockData, source: str) -> None:
        """Keep this block regardless of the byte bound (warm-up prefixes)."""
        old = self._entries.pop(h, None)
        if old is not None:
            self.bytes -= old.data.nbytes
        self._pinned[h] = _HostEntry(data, source)

    def put(self, h: BlockHash, data: BlockData, source: str) -> list[BlockHash]:
        """Keep the block (most recently used); returns the hashes evicted to make room.
        A block larger than the whole tier, or pinned already, is not taken."""
        if data.nbytes > self.max_bytes or h in self._pinned:
            return []
        old = self._entries.pop(h, None)
        if old is not None:
            self.bytes -= old.data.nbytes
        self._entries[h] = _HostEntry(data, source)
        self.bytes += data.nbytes
        evicted = []
        while self.bytes > self.max_bytes:
            gone_hash, gone = self._entries.popitem(last=False)
            self.bytes -= gone.data.nbytes
            self.evictions += 1
            evicted.append(gone_hash)
        return evicted

    def clear(self) -> list[BlockHash]:
        """Drop every block, pinned ones too (a cache flush). Returns their hashes."""
        hashes = [*self._entries, *self._pinned]
        self._entries.clear()
        self._pinned.clear()
        self.bytes = 0
        return hashes

    def get(self, h: BlockHash) -> tuple[BlockData, str] | None:
        """The block and its source, touched as most recently used; None if absent."""
        e = self._pinned.get(h)
        if e is not None:
            self.hits += 1
            return e.data, e.source
        e = self._entries.get(h)
        if e is None:
            return None
        self._entries.move_to_end(h)
        self.hits += 1
        return e.data, e.source
