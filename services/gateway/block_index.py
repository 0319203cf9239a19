"""The router's indexes of which worker holds which KV block (no torch).

- `WorkerIndex`: one worker's blocks as its KV events describe them (hash -> tier bits, LRU
  bounded), applied in `seq` order.
- `BlockHolders`: every block's holders as a bit mask of worker slots, kept in step with the
  WorkerIndexes (and, for requests routed but not finished, with the router's pending hashes).
  It lets `leading_runs` find every worker's leading run of a prompt in one walk over the
  prompt's blocks, whatever the number of workers (Dynamo's KV indexer keeps worker sets per
  radix node for the same reason): a walk per worker costs workers x blocks dictionary lookups,
  over a millisecond at 64 workers sharing a prefix.

Invariants: a worker's slot bit is set in `BlockHolders` for exactly the hashes its index
holds; `forget` clears them all (the worker left, or restarted under a new incarnation).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvserve.shared.protocol import KVEvent, WorkerInfo

# A worker's own tiers as bits, so one hash can be in several at once.
TIER_BITS = {"device": 1, "host": 2}


class BlockHolders:
    """hash -> bit mask of the worker slots holding it."""

    def __init__(self) -> None:
        self.masks: dict[bytes, int] = {}

    def add(self, h: bytes, bit: int) -> None:
        self.masks[h] = self.masks.get(h, 0) | bit

    def discard(self, h: bytes, bit: int) -> None:
        rest = self.masks.get(h, 0) & ~bit
        if rest:
            self.masks[h] = rest
        else:
            self.masks.pop(h, None)

    def __len__(self) -> int:
        return len(self.masks)


def leading_runs(
    hashes: Sequence[bytes], slots: Mapping[str, int], *holders: BlockHolders
) -> dict[str, int]:
    """For each worker of `slots` (name -> slot bit), how many leading `hashes` it holds in
    any of `holders`: one walk, stopping where the last worker's run ends."""
    names = {bit: name for name, bit in slots.items()}
    active = 0
    for bit in names:
        active |= bit
    runs: dict[str, int] = {}
    maps = [h.masks for h in holders]
    for i, h in enumerate(hashes):
        held = 0
        for masks in maps:
            held |= masks.get(h, 0)
        lost = active & ~held
        while lost:
            low = lost & -lost
            runs[names[low]] = i
            lost ^= low
        active &= held
        if not active:
            return runs
    for bit, name in names.items():
        if active & bit:
            runs[name] = len(hashes)
    return runs


def runs_from(hashes: Sequence[bytes], present: Callable[[bytes], bool]) -> list[int]:
    """`ends[i]`: the index of the first hash at or after i that is not `present` (so the run
    present from i is ends[i] - i), for every i in 0..len(hashes); one lookup per hash."""
    ends = [len(hashes)] * (len(hashes) + 1)
    for i in range(len(hashes) - 1, -1, -1):
        ends[i] = ends[i + 1] if present(hashes[i]) else i
    return ends


def leading(hashes: Sequence[bytes], present: Callable[[bytes], bool]) -> int:
    """Length of the leading run of `hashes` for which `present` holds."""
    n = 0
    for h in hashes:
        if not present(h):
            break
        n += 1
    return n


class WorkerIndex:
    """One worker's blocks as its events describe them: hash -> tier bits, in LRU order (the
    most recently stored last), at most `max_blocks` hashes. Tier-"store" blocks and unknown
    tiers are sequenced but not held here. With `holders`, every hash entering or leaving the
    index sets or clears the worker's `bit` there."""

    def __init__(
        self,
        info: WorkerInfo,
        max_blocks: int,
        holders: BlockHolders | None = None,
        bit: int = 0,
    ) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.info = info
        self.max_blocks = max_blocks
        self.last_seq: int | None = None
        self.resyncs = 0
        self.holders = holders if holders is not None else BlockHolders()
        self.bit = bit
        self._tiers: OrderedDict[bytes, int] = OrderedDict()

    def apply(self, event: KVEvent) -> str:
        """Apply one event; the outcome is "applied", "duplicate", "stale" or "gap"."""
        outcome = self._sequence(event)
        if outcome in ("stale", "duplicate"):
            return outcome
        if outcome == "gap":
            self.forget()
            self.resyncs += 1
        self.last_seq = event.seq
        self._change(event)
        return outcome

    def remember(self, hashes: Iterable[bytes]) -> None:
        """Blocks the worker has just computed for a request routed to it, held as device
        blocks ahead of its own events (which confirm or remove them)."""
        self._store(hashes, TIER_BITS["device"])

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` are present in any tier."""
        return leading(hashes, self._tiers.__contains__)

    def forget(self) -> None:
        """Drop every block (and the worker's bit for each in `holders`)."""
        for h in self._tiers:
            self.holders.discard(h, self.bit)
        self._tiers.clear()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._tiers

    def __len__(self) -> int:
        return len(self._tiers)

    def _sequence(self, event: KVEvent) -> str:
        if event.incarnation != self.info.incarnation:
            return "stale"
        if self.last_seq is None:
            return "gap" if event.seq > 0 else "applied"
        if event.seq <= self.last_seq:
            return "duplicate"
        return "gap" if event.seq > self.last_seq + 1 else "applied"

    def _change(self, event: KVEvent) -> None:
        if event.op == "cleared":
            self.forget()  # device and host are the only tiers held here
            return
        bit = TIER_BITS.get(event.tier)
        if bit is None:
            return
        if event.op == "stored":
            self._store(event.block_hashes, bit)
        elif event.op == "removed":
            self._remove(event.block_hashes, bit)

    def _store(self, hashes: Iterable[bytes], bit: int) -> None:
        tiers = self._tiers
        for h in hashes:
            before = tiers.get(h)
            if before is None:
                self.holders.add(h, self.bit)
            tiers[h] = (before or 0) | bit
            tiers.move_to_end(h)
        while len(tiers) > self.max_blocks:
            evicted, _ = tiers.popitem(last=False)
            self.holders.discard(evicted, self.bit)

    def _remove(self, hashes: Iterable[bytes], bit: int) -> None:
        for h in hashes:
            rest = self._tiers.get(h, 0) & ~bit
            if rest:
                self._tiers[h] = rest
            elif self._tiers.pop(h, None) is not None:
                self.holders.discard(h, self.bit)
