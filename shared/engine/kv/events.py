"""TierLog: every block that entered or left a tier, counted, and (once enabled) logged as
TierEvents for a reader on another thread (a worker publishes them as KV events for routers).

Invariants:
- `entered` / `left` count each block by (tier, kind) in `counts` (reported by the manager's
  stats) whether or not the log is enabled.
- The log is a deque: the engine thread appends, the worker's event loop takes (`take`). Past
  `max_events` unread it is replaced by a single "cleared": readers forget this engine's blocks
  rather than keep a wrong picture.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.shared.store.hashing import BlockHash


@dataclass(frozen=True)
class TierEvent:
    """Blocks that entered ("stored") or left ("removed") a tier, or "cleared" (the device and
    host tiers dropped everything unreferenced)."""

    kind: str
    tier: str
    hashes: tuple[BlockHash, ...] = ()


class TierLog:
    def __init__(self, max_events: int = 100_000) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.max_events = max_events
        self._events: deque[TierEvent] | None = None

    def enable(self) -> None:
        """Log every tier change from now on, for `take`."""
        if self._events is None:
            self._events = deque()

    def take(self) -> list[TierEvent]:
        """The tier changes logged since the previous call, oldest first (any thread)."""
        out: list[TierEvent] = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def entered(self, tier: str, hashes: Sequence[BlockHash]) -> None:
        if hashes:
            self.counts[(tier, "stored")] += len(hashes)
            self.log(TierEvent("stored", tier, tuple(hashes)))

    def left(self, tier: str, hashes: Sequence[BlockHash]) -> None:
        if hashes:
            self.counts[(tier, "removed")] += len(hashes)
            self.log(TierEvent("removed", tier, tuple(hashes)))

    def snapshot(self, held: dict[str, list[BlockHash]], chunk: int = 512) -> None:
        """Log a "cleared", then every block each tier holds (`held`: tier -> hashes), for a
        reader that lost track."""
        self.log(TierEvent("cleared", ""))
        for tier, hashes in held.items():
            for i in range(0, len(hashes), chunk):
                self.log(TierEvent("stored", tier, tuple(hashes[i : i + chunk])))

    def log(self, event: TierEvent) -> None:
        if self._events is None:
            return
        if len(self._events) >= self.max_events:
            self._events.clear()
            event = TierEvent("cleared", "")
        self._events.append(event)
