"""Store URLs: which backend a URL opens (`open_store`), and the check the command line runs
before anything starts (`check_store_url`). Backends are imported when a URL asks for them
(the Redis client only where a Redis URL is used)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from kvserve.shared.store.base import BlockStore

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
