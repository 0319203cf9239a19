"""A benchmark's own namespace in a Redis it shares with others: a fresh name per use, and the
keys under it deleted once the benchmark is done with them (a 2,048-token prefix is ~25-95 MB
of frames; a run of the store benchmarks leaves none behind)."""

from __future__ import annotations

import uuid


def fresh_namespace(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


def drop_namespace(redis_url: str, namespace: str) -> int:
    """Delete every key under `namespace` from the Redis at `redis_url`; how many there were."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        deleted, batch = 0, []
        for key in client.scan_iter(match=f"{namespace}:*", count=1000):
            batch.append(key)
            if len(batch) == 1000:
                deleted += client.unlink(*batch)
                batch.clear()
        return deleted + (client.unlink(*batch) if batch else 0)
    finally:
        client.close()
