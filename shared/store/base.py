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
from collections.abc import Sequence
from urllib.parse import parse_qs, urlsplit

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


_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"1048576"``, ``"64k"``, ``"512MiB"``, ``"2g"`` -> bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in _SIZE_SUFFIXES:
        return int(float(t[:-1]) * _SIZE_SUFFIXES[t[-1]])
    return int(t)


STORE_SCHEMES = ("memory", "file", "redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def check_store_url(url: str) -> None:
    """Raise ValueError (a one-line message) for a URL `open_store` cannot open."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in STORE_SCHEMES:
        raise ValueError(f"unknown store URL scheme {parts.scheme!r} in {url!r}")
    if parts.scheme.lower() == "file" and (
        parts.netloc not in ("", "localhost") or not parts.path.startswith("/")
    ):
        raise ValueError(f"file store needs an absolute path: file:///abs/dir, got {url!r}")


def open_store(url: str) -> BlockStore:
    """Open a backend from a URL.

    - ``memory://?max_bytes=1g``
    - ``file:///abs/dir?max_bytes=100g``
    - ``redis://host:port/db?ttl=86400&timeout=0.25&attempts=2&backoff=0.01&failures=5&cooldown=5``
      (``ttl=0`` means no TTL; other query parameters go to redis-py).
    - ``redis+cluster://host:port[,host2:port2...]/?ttl=...`` (Redis Cluster: the netloc lists
      startup nodes; the same query parameters as ``redis://``; ``rediss+cluster://`` for TLS).
    """
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    scheme = parts.scheme.lower()
    if scheme == "memory":
        from kvserve.shared.store.memory import DEFAULT_MAX_BYTES, MemoryStore

        return MemoryStore(max_bytes=parse_size(query.get("max_bytes", str(DEFAULT_MAX_BYTES))))
    if scheme == "file":
        from kvserve.shared.store.disk import DEFAULT_MAX_BYTES as DISK_MAX
        from kvserve.shared.store.disk import DiskStore

        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"file store needs an absolute path: file:///abs/dir, got {url!r}")
        return DiskStore(parts.path, max_bytes=parse_size(query.get("max_bytes", str(DISK_MAX))))
    if scheme in ("redis", "rediss", "unix"):
        from kvserve.shared.store.redis import RedisStore

        return RedisStore.from_url(url)
    if scheme in ("redis+cluster", "rediss+cluster"):
        from kvserve.shared.store.redis_cluster import RedisClusterStore

        return RedisClusterStore.from_url(url)
    raise ValueError(f"unknown store URL scheme {parts.scheme!r} in {url!r}")
