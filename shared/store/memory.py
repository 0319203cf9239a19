"""MemoryStore: a byte-bounded LRU of blocks in this process's RAM, and the ByteLRU index it
shares with the disk store.

Eviction order: least recently used first, where "used" means written (``put_many``) or read
(a ``get_many`` hit); ``contains`` does not touch recency. Pinned blocks are never evicted and still
count toward ``max_bytes``; when only pinned blocks remain, a write that does not fit is skipped.
A single value larger than ``max_bytes`` is skipped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvserve.shared.store.base import BlockStore, StoreStats
from kvserve.shared.store.hashing import BlockHash

DEFAULT_MAX_BYTES = 1 << 30


class ByteLRU:
    """Sizes of the blocks a store holds, in recency order, under a byte budget.

    Owns only bookkeeping (key -> size, pins); the caller owns the bytes and must drop the data of
    every key ``admit`` returns as evicted. Unpinned present keys live in ``_lru`` (oldest first),
    pinned present keys in ``_pinned``; ``pins`` may also name keys not present yet.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self.used = 0
        self.pins: set[bytes] = set()
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._pinned: dict[bytes, int] = {}
        self._pinned_bytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru or key in self._pinned

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)

    def lru_order(self) -> list[bytes]:
        """Unpinned keys, next to be evicted first."""
        return list(self._lru)

    def size(self, key: bytes) -> int | None:
        s = self._lru.get(key)
        return self._pinned.get(key) if s is None else s

    def touch(self, key: bytes) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def admit(self, key: bytes, size: int) -> list[bytes] | None:
        """Account ``key`` at ``size`` bytes as most recently used. Returns the keys evicted to
        make room (oldest unpinned first), or None when it cannot fit (nothing changed then)."""
        old = self.size(key) or 0
        if size > self.max_bytes:
            return None
        evictable = self.used - self._pinned_bytes - self._lru.get(key, 0)
        if self.used - old + size - evictable > self.max_bytes:
            return None
        evicted: list[bytes] = []
        while self.used - old + size > self.max_bytes:
            victim = next(k for k in self._lru if k != key)
            self.used -= self._lru.pop(victim)
            evicted.append(victim)
        self.remove(key)
        if key in self.pins:
            self._pinned[key] = size
            self._pinned_bytes += size
        else:
            self._lru[key] = size
        self.used += size
        return evicted

    def remove(self, key: bytes) -> bool:
        s = self._lru.pop(key, None)
        if s is None:
            s = self._pinned.pop(key, None)
            if s is not None:
                self._pinned_bytes -= s
        if s is None:
            return False
        self.used -= s
        return True

    def pin(self, key: bytes) -> None:
        self.pins.add(key)
        s = self._lru.pop(key, None)
        if s is not None:
            self._pinned[key] = s
            self._pinned_bytes += s

    def unpin(self, key: bytes) -> None:
        self.pins.discard(key)
        s = self._pinned.pop(key, None)
        if s is not None:
            self._pinned_bytes -= s
            self._lru[key] = s


class MemoryStore(BlockStore):
    """Blocks in a dict, bounded by ``max_bytes`` of values via ByteLRU. Single event loop only."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._index = ByteLRU(max_bytes)
        self._data: dict[bytes, bytes] = {}
        self._stats = StoreStats()

    async def get_many(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for h in hashes:
            v = self._data.get(h)
            if v is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
                self._index.touch(h)
            out.append(v)
        return out

    async def put_many(
        self, items: Sequence[tuple[BlockHash, bytes]], ttl_s: int | None = None
    ) -> int:
        written = 0
        for h, value in items:
            evicted = self._index.admit(h, len(value))
            if evicted is None:
                self._stats.skipped_writes += 1
                continue
            for k in evicted:
                del self._data[k]
            self._stats.evictions += len(evicted)
            self._data[h] = bytes(value)
            written += 1
        self._stats.puts += written
        return written

    async def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        return [h in self._data for h in hashes]

    async def delete(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._index.unpin(h)
            self._index.remove(h)
            self._data.pop(h, None)

    async def pin(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._index.pin(h)

    async def unpin(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._index.unpin(h)

    def lru_order(self) -> list[bytes]:
        """Unpinned hashes, next to be evicted first (for tests and admin)."""
        return self._index.lru_order()

    def stats(self) -> dict[str, object]:
        self._stats.bytes_stored = self._index.used
        d = self._stats.as_dict()
        d.update(backend="memory", blocks=len(self._index), max_bytes=self._index.max_bytes)
        d["pinned"] = len(self._index.pins)
        return d

    async def close(self) -> None:
        self._data.clear()
