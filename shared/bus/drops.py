"""BusDrops: the bus entries a reader refused, counted by stream kind and reason.

Nothing read off the bus is trusted. Every reader of a Redis stream or hash of the bus passes
what it read through its bus's (or worker port's) BusDrops, which hands back the message or
None. An entry is refused, counted under (stream kind, reason) and logged, and its reader goes
on with the next one, when it is

- "oversized": longer than `max_message_bytes` (checked before anything is decoded);
- "missing_field": a stream entry without its `m` field;
- "stale": a token event of a delivery that was taken over since (its epoch is below the
  fence's: a paused worker's late event);
- "not_msgpack": not msgpack, or msgpack cut short;
- "version": of another protocol (or sampling-map) version, or of none;
- "invalid": anything else (not a map, an unknown kind, a missing, unknown or mistyped field, a
  value out of range, a message of another kind than its stream carries, another request's
  event, a key of the wrong Redis type).

Stream kinds: "requests" (the shared request stream and the workers' own), "cancel", "events"
(a request's token events, read by its gateway or by a worker taking the request over),
"kv_events", "worker_info", "worker_stats" and "resync". What the caller does with a refused
entry is its own: a worker acks and deletes a refused request (it is never delivered again),
the other readers move their cursor past it.

Invariants: the counts only grow. A hash value (worker_info, worker_stats) is read again on
every poll: one refused under `repeat_key` is counted once, until that key holds a value that
is accepted. One warning per (stream, reason) at most every `log_every_s` seconds (the first at
once), with how many were dropped since the previous one.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kvserve.shared.protocol import Message, ProtocolError, decode

log = logging.getLogger("kvserve.shared.bus")

STREAMS = ("requests", "cancel", "events", "kv_events", "worker_info", "worker_stats", "resync")
REASONS = ("oversized", "missing_field", "stale", *ProtocolError.REASONS)
_MAX_REPEAT_KEYS = 4096  # hash fields remembered as refused (one per live worker and hash)

T = TypeVar("T")


class BusDrops:
    """Counts (and logs) the entries refused; owned by one bus or worker port, mutated only by
    its readers (one event loop)."""

    def __init__(self, max_message_bytes: int, log_every_s: float = 10.0) -> None:
        self.max_message_bytes = max_message_bytes
        self.log_every_s = log_every_s
        self._counts: Counter[tuple[str, str]] = Counter()
        self._unlogged: Counter[tuple[str, str]] = Counter()
        self._logged_at: dict[tuple[str, str], float] = {}
        self._refused: dict[str, bytes] = {}  # repeat_key -> digest of the value refused

    def message(self, stream: str, fields: Mapping[bytes, Any], where: str) -> Message | None:
        """The message in a stream entry's `m` field, or None (the entry counted as dropped)."""
        data = fields.get(b"m")
        if data is None:
            self.record(stream, "missing_field", where, "no 'm' field")
            return None
        return self.check(stream, data, where, decode)

    def check(
        self,
        stream: str,
        data: Any,
        where: str,
        parse: Callable[[Any], T],
        repeat_key: str | None = None,
    ) -> T | None:
        """`parse(data)` (which raises ProtocolError for what it refuses), or None: `data` was
        oversized or refused, and counted (see the module docstring for `repeat_key`)."""
        digest = _digest(data) if repeat_key is not None else b""
        if repeat_key is not None and self._refused.get(repeat_key) == digest:
            return None  # the value refused before, read again
        try:
            if len(data) > self.max_message_bytes:
                raise ProtocolError(
                    f"{len(data)} bytes, over the bound of {self.max_message_bytes}", "oversized"
                )
            value = parse(data)
        except ProtocolError as e:
            self.record(stream, e.reason, where, str(e))
            if repeat_key is not None:
                if len(self._refused) >= _MAX_REPEAT_KEYS:
                    self._refused.clear()
                self._refused[repeat_key] = digest
            return None
        if repeat_key is not None:
            self._refused.pop(repeat_key, None)
        return value

    def record(self, stream: str, reason: str, where: str, detail: str) -> None:
        """Count one dropped entry; log it unless this (stream, reason) was logged lately."""
        key = (stream, reason)
        self._counts[key] += 1
        now = time.monotonic()
        last = self._logged_at.get(key)
        if last is not None and now - last < self.log_every_s:
            self._unlogged[key] += 1
            return
        self._logged_at[key] = now
        log.warning(
            "dropped a bus message: stream=%s reason=%s at %s (%s); %d more since the last "
            "such warning",
            stream,
            reason,
            where,
            detail[:200],
            self._unlogged.pop(key, 0),
        )

    def count(self, stream: str, reason: str) -> int:
        return self._counts[(stream, reason)]

    def snapshot(self) -> dict[str, dict[str, int]]:
        """{stream kind: {reason: entries dropped}}, only what was dropped at least once."""
        out: dict[str, dict[str, int]] = {}
        for (stream, reason), n in sorted(self._counts.items()):
            out.setdefault(stream, {})[reason] = n
        return out


def _digest(data: Any) -> bytes:
    raw = data if isinstance(data, bytes) else repr(data).encode()
    return hashlib.blake2b(raw, digest_size=16).digest()
