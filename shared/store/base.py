"""BlockStore: the one async interface every prefix-store backend implements.

Invariants shared by all backends:

- Keys are block hashes (``BlockHash``, 32 raw bytes); values are opaque ``bytes`` (encoded block
  frames made by the codec). A store never inspects, decodes or validates a value.
- A store never raises into its caller for an unavailable or full backend: reads of blocks it cannot
  serve answer ``None`` (a miss), writes it cannot make are skipped and counted. Only programming
  errors (bad arguments) raise.
- Results are positional: ``get_many(hs)[i]`` / ``contains(hs)[i]`` / ``presence(hs)`` answer
  ``hs[i]``.
- A store with a circuit breaker (Redis) says which hashes a ``presence`` call did not ask about
  because the breaker was open for them (``Presence.short_circuited``); those read as absent.
- Pinned hashes are exempt from the store's eviction and TTL. A pin may name a block that is not
  stored yet; it applies when the block arrives. ``delete`` drops the pin too.
- ``stats()`` is cheap and synchronous; every backend reports at least the keys of
  ``StoreStats``.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Sequence

from kvserve.shared.store.hashing import BlockHash

KEY_NAMESPACE = "kvserve:v1"


def block_key(h: BlockHash, namespace: str = KEY_NAMESPACE) -> str:
    """The store key of a block: ``kvserve:v1:blk:{hex}``."""
    return f"{namespace}:blk:{h.hex()}"


def pinned_set_key(namespace: str = KEY_NAMESPACE) -> str:
    return f"{namespace}:pinned"


@dataclasses.dataclass
class StoreStats:
    """Counters every backend keeps; all are monotonic except ``bytes_stored``."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_errors: int = 0
    get_errors: int = 0
    skipped_writes: int = 0
    evictions: int = 0
    bytes_stored: int = 0

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Presence:
    """What a store said of each asked hash (positional): ``stored[i]``, whether it holds it, and
    ``short_circuited[i]``, whether it was not asked at all because the store's circuit breaker
    was open for it (then ``stored[i]`` is False)."""

    stored: list[bool]
    short_circuited: list[bool]

    @classmethod
    def answered(cls, stored: list[bool]) -> Presence:
        """Every hash asked and answered (a store without a breaker, or one closed)."""
        return cls(stored, [False] * len(stored))


class BlockStore(ABC):
    """A key-value store of encoded blocks; see the module docstring for the invariants."""

    @abstractmethod
    async def get_many(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """The stored value of each hash, or None (missing, evicted, or store unavailable)."""

    async def connect(self, read_bytes: int = 0) -> None:  # noqa: B027 - most have nothing to open
        """Open what the first call would otherwise open (connections, and buffers for reads
        of `read_bytes`: a chunk of `stream_views`), so that the first lookup does not pay for
        it; never raises (a store that is down is found out later)."""

    def recycle(self, values: Sequence[bytes | memoryview | None]) -> None:  # noqa: B027
        """Hand back a chunk of `stream_views` that the caller is done with (it must not read
        those values afterwards): a store that reads into buffers of its own reuses theirs."""

    async def get_views(self, hashes: Sequence[BlockHash]) -> Sequence[bytes | memoryview | None]:
        """As `get_many`, the values possibly as read-only-by-convention memoryviews of the
        store's reply buffer (what a load reads in place); a reader must not write into them."""
        return await self.get_many(hashes)

    async def stream_views(
        self, hashes: Sequence[BlockHash], chunk: int
    ) -> AsyncGenerator[Sequence[bytes | memoryview | None], None]:
        """`get_views` of `hashes` a chunk of `chunk` at a time, each chunk as soon as it is in
        (a store that can keeps every chunk's read in flight at once). A chunk the store could
        not answer is all None, as in `get_many`."""
        for i in range(0, len(hashes), chunk):
            yield await self.get_views(hashes[i : i + chunk])

    @abstractmethod
    async def put_many(
        self, items: Sequence[tuple[BlockHash, bytes]], ttl_s: int | None = None
    ) -> int:
        """Store each (hash, value); returns how many were written (the rest were skipped).
        `ttl_s`: a shorter life than the store's own for these values (a hand-off's tail);
        stores without expiry (memory, disk) evict by size alone."""

    @abstractmethod
    async def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether each hash is stored. Does not count as a use (no LRU touch, no hit/miss)."""

    async def presence(self, hashes: Sequence[BlockHash]) -> Presence:
        """``contains``, plus which hashes an open circuit breaker kept from being asked; a store
        without a breaker asks about every one (this default)."""
        return Presence.answered(await self.contains(hashes))

    @abstractmethod
    async def delete(self, hashes: Sequence[BlockHash]) -> None:
        """Remove the blocks and their pins; missing hashes are ignored."""

    @abstractmethod
    async def pin(self, hashes: Sequence[BlockHash]) -> None:
        """Exempt the hashes from eviction and TTL until unpinned."""

    @abstractmethod
    async def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """Make the hashes evictable again (they become the most recently used)."""

    @abstractmethod
    def stats(self) -> dict[str, object]:
        """Counters (StoreStats keys at least) plus backend-specific entries."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections / flush state. The store is unusable afterwards."""
