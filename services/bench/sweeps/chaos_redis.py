"""The Redis servers of a `kvserve bench chaos` rig, laid out as compose.yaml lays them out: the
`bus` (request streams, token events, registrations: `noeviction`, bounded generously) and the
`store` (the prefix store: `allkeys-lru`); `kvserve serve` keeps its bus in the process and has
the store alone. Each is a redis-server of the rig's own behind a ThreadedFaultProxy of its own:
kvserve reaches it only through the proxy, the bench reads and sets it directly.

Invariants: a node's `url` is its proxy's; `client()` bypasses the proxy and fails fast (no
retries, 5 s timeouts), so that reading a paused or dead server costs the bench 5 s at most.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.redis_server import RedisServer
from kvserve.services.bench.lib.tcp_proxy import ThreadedFaultProxy

BUS_MAXMEMORY = "1gb"  # compose.yaml's default
STORE_MAXMEMORY = "2gb"
PREFIX = "kvserve"  # the bus's and the store's default namespace
BLOCK_KEYS = f"{PREFIX}:v1:blk:*"  # the store's block keys


class RedisNode:
    """One of the rig's Redis servers (`role`: "bus" or "store") and the proxy in front of it;
    `log` is the server's log file."""

    def __init__(self, role: str, log: Path) -> None:
        self.role = role
        if role == "bus":
            bound = ["--maxmemory", BUS_MAXMEMORY, "--maxmemory-policy", "noeviction"]
            self.server = RedisServer(extra_args=bound, log=log)
        else:
            self.server = RedisServer(maxmemory=STORE_MAXMEMORY, log=log)
        self.proxy: ThreadedFaultProxy | None = None

    @property
    def url(self) -> str:
        """What kvserve is given: the proxy's address."""
        assert self.proxy is not None, "not started"
        return f"redis://127.0.0.1:{self.proxy.port}/0"

    def start(self) -> None:
        self.server.start()
        self.proxy = ThreadedFaultProxy("127.0.0.1", self.server.port)
        self.proxy.start()

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        self.server.stop()

    def client(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(port=self.server.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))

    def info(self, section: str) -> dict[str, Any]:
        """INFO `section`, asked directly; {} when the server does not answer."""
        r = self.client()
        try:
            return dict(r.info(section))
        except Exception:  # down or paused: nothing to read
            return {}
        finally:
            r.close()

    def used_mb(self) -> float:
        return int(self.info("memory").get("used_memory", 0)) / (1 << 20)

    def evicted_keys(self) -> int | None:
        stats = self.info("stats")
        return int(stats["evicted_keys"]) if "evicted_keys" in stats else None

    def stored_blocks(self) -> int:
        """Store blocks held now (0 when the server does not answer)."""
        r = self.client()
        try:
            return sum(1 for _ in r.scan_iter(match=BLOCK_KEYS, count=1000))
        except Exception:
            return 0
        finally:
            r.close()


def stream_keys(r: Any) -> list[str]:
    """Every stream of the bus's namespace."""
    keys = r.scan_iter(match=f"{PREFIX}:*", count=1000, _type="stream")
    return sorted(k.decode() if isinstance(k, bytes) else str(k) for k in keys)


def bus_streams(node: RedisNode) -> dict[str, dict[str, int]]:
    """Each bus stream's length and its consumer groups' pending entries, summed:
    {key: {"len": n, "pending": n}} ({} when the server does not answer)."""
    r = node.client()
    try:
        keys = stream_keys(r)
        pipe = r.pipeline(transaction=False)
        for key in keys:
            pipe.xlen(key)
            pipe.xinfo_groups(key)
        replies = pipe.execute(raise_on_error=False)
    except Exception:
        return {}
    finally:
        r.close()
    out = {}
    for key, length, groups in zip(keys, replies[::2], replies[1::2], strict=True):
        if isinstance(length, Exception) or isinstance(groups, Exception):
            continue  # expired between the scan and the read
        out[key] = {"len": int(length), "pending": sum(int(g["pending"]) for g in groups)}
    return out
