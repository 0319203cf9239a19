"""How the Redis bus lays itself out in Redis: its settings, its key names, and reading its
messages off a stream.

Keys (under `prefix`, "kvserve" by default): requests on `{p}:prefill` (shared) and on each
worker's own `{p}:to:{name}` (routed), each read through the consumer group `group`; token
events on `{p}:out:{id}` (expiring); cancels on the broadcast stream `{p}:cancel`, plus a
short-lived `{p}:cancelled:{id}` for requests not yet picked up; the sorted set `{p}:workers`
(score: last heartbeat), the hashes `{p}:worker_info` and `{p}:worker_stats`; KV events on the
bounded stream `{p}:kv_events`; a router's snapshot request in `{p}:resync:{name}`; a
taken-over request's probation holder and strikes in `{p}:probation:{id}` and `{p}:strikes:{id}`
(expiring).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from kvserve.shared.bus.drops import BusDrops

M = TypeVar("M")


@dataclass(frozen=True)
class RedisBusConfig:
    prefix: str = "kvserve"
    request_stream: str = "prefill"  # full key: {prefix}:{request_stream}
    group: str = "prefill"
    claim_idle_s: float = 30.0  # a pending request idle this long belongs to a dead worker
    heartbeat_s: float = 2.0
    worker_ttl_s: float = 10.0  # a worker without a heartbeat for this long is not alive
    out_ttl_s: int = 600  # per-request event streams expire (a gateway that died never reads)
    cancel_ttl_s: int = 600
    # A backstop: a request delivered this many times is failed (quarantined) whatever happened
    # to it. Workers quarantine a request that killed its workers much sooner (strikes, on the
    # worker's --quarantine-after); this bounds what no strike catches.
    max_deliveries: int = 8
    cancel_stream_maxlen: int = 10_000
    kv_events_maxlen: int = 100_000  # a router that falls further behind resynchronises
    # redis-py 8 gives up on a reply after 5 s; a host whose cores are saturated by the engines
    # (or a Redis busy with large store writes) stalls longer than that without being down.
    socket_timeout_s: float = 30.0
    # Connections the client may open. The requests in flight at a gateway wait for their events
    # on one connection (`_EventReader`), but a burst of submits and cancels takes one each
    # while it runs, and redis-py raises "Too many connections" past the bound instead of
    # waiting (with its default of 100, a burst of 101 requests would get a 503).
    max_connections: int = 1024
    # How long the gateway's one XREAD waits before it is issued again (a new request wakes it
    # at once); below socket_timeout_s.
    read_block_ms: int = 1000
    # An entry (or hash value) longer than this is dropped unread (shared/bus/drops.py). The
    # largest legitimate message is a request of a full context window: at most 5 bytes per
    # token id in msgpack (uint32), so 1M tokens (8x Llama 3.1's 128K window, the longest of
    # the Llama models it loads) take 5 MB; the rest leaves room for its sampling map, for a
    # warm-up job's prefixes (bounded by the gateway's request body limit, 1 MiB by default)
    # and for a token event.
    max_message_bytes: int = 8 << 20


class RedisKeys:
    """The bus's key names under `config.prefix` (plain strings; nothing here talks to Redis)."""

    def __init__(self, config: RedisBusConfig) -> None:
        p = self.prefix = config.prefix
        self.request_key = f"{p}:{config.request_stream}"
        self.cancel_key = f"{p}:cancel"
        self.workers_key = f"{p}:workers"
        self.stats_key = f"{p}:worker_stats"
        self.info_key = f"{p}:worker_info"
        self.kv_events_key = f"{p}:kv_events"

    def out_key(self, request_id: str) -> str:
        return f"{self.prefix}:out:{request_id}"

    def cancelled_key(self, request_id: str) -> str:
        return f"{self.prefix}:cancelled:{request_id}"

    def probation_key(self, request_id: str) -> str:
        """Which worker incarnation runs the taken-over request on probation (its first
        step, alone), while it does."""
        return f"{self.prefix}:probation:{request_id}"

    def strikes_key(self, request_id: str) -> str:
        """How many workers died while running the request on probation."""
        return f"{self.prefix}:strikes:{request_id}"

    def resync_key(self, worker: str) -> str:
        return f"{self.prefix}:resync:{worker}"

    def to_key(self, worker: str) -> str:
        """The worker's own request stream (requests routed to it)."""
        return f"{self.prefix}:to:{worker}"


async def registered_workers(
    redis: Any, keys: RedisKeys, config: RedisBusConfig, alive: bool
) -> list[str]:
    """Registered workers whose last heartbeat is within `worker_ttl_s` (`alive`), or not (a
    heartbeat that stopped, or a worker that closed)."""
    since = time.time() - config.worker_ttl_s
    low, high = (since, "+inf") if alive else (0, since)
    names = []
    for n in await redis.zrangebyscore(keys.workers_key, low, high):
        with contextlib.suppress(UnicodeDecodeError):  # not text: no worker's name
            names.append(text(n))
    return names


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_messages(
    reply: Any, kind: type[M], cursor: Any, drops: BusDrops, stream: str
) -> tuple[list[M], Any]:
    """The messages of `kind` in an XREAD reply and the id of the last entry read (`cursor`
    when there was none); any other entry is dropped and counted in `drops` under `stream`."""
    out: list[M] = []
    for key, entries in reply or []:
        for entry_id, fields in entries:
            cursor = entry_id
            where = f"{text(key)} {text(entry_id)}"
            msg = drops.message(stream, fields or {}, where)
            if isinstance(msg, kind):
                out.append(msg)
            elif msg is not None:
                drops.record(stream, "invalid", where, f"a {msg.KIND} message, not {kind.__name__}")
    return out, cursor
