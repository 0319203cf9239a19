"""ModelledTransfers: a store backend's calls made to last as long as moving the modelled model's
true blocks would, for a simulated engine whose KV payload is smaller than the model's.

Each direction (reads, writes) is a link: a call of n blocks occupies it for n * the per-block
cost after the calls before it, then pays one round trip; so concurrent calls queue as they
would on one connection's bandwidth, and a call never ends earlier than the real backend
answered. Everything else (keys, frames, misses, the breaker) is the real backend's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from kvserve.shared.engine.sim.profile import StoreCost
from kvserve.shared.store.base import BlockStore, Presence
from kvserve.shared.store.hashing import BlockHash


class _Link:
    """One direction's occupancy, in the event loop's time."""

    def __init__(self, per_block_s: float, rtt_s: float) -> None:
        self.per_block_s = per_block_s
        self.rtt_s = rtt_s
        self.busy_until = 0.0

    def reserve(self, blocks: int) -> float:
        """When a call of `blocks` blocks started now ends (monotonic seconds)."""
        now = time.monotonic()
        self.busy_until = max(now, self.busy_until) + blocks * self.per_block_s
        return self.busy_until + self.rtt_s


async def _until(deadline: float) -> None:
    left = deadline - time.monotonic()
    if left > 0:
        await asyncio.sleep(left)


class ModelledTransfers(BlockStore):
    def __init__(self, inner: BlockStore, cost: StoreCost, time_scale: float = 1.0) -> None:
        self.inner = inner
        rtt = cost.rtt_s * time_scale
        self._reads = _Link(cost.load_s_per_block * time_scale, rtt)
        self._writes = _Link(cost.write_s_per_block * time_scale, rtt)

    async def get_many(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        end = self._reads.reserve(len(hashes))
        got = await self.inner.get_many(hashes)
        await _until(end)
        return got

    async def put_many(
        self, items: Sequence[tuple[BlockHash, bytes]], ttl_s: int | None = None
    ) -> int:
        end = self._writes.reserve(len(items))
        written = await self.inner.put_many(items, ttl_s)
        await _until(end)
        return written

    async def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        end = self._reads.reserve(0)
        found = await self.inner.contains(hashes)
        await _until(end)
        return found

    async def presence(self, hashes: Sequence[BlockHash]) -> Presence:
        end = self._reads.reserve(0)
        found = await self.inner.presence(hashes)
        await _until(end)
        return found

    async def delete(self, hashes: Sequence[BlockHash]) -> None:
        await self.inner.delete(hashes)

    async def pin(self, hashes: Sequence[BlockHash]) -> None:
        await self.inner.pin(hashes)

    async def unpin(self, hashes: Sequence[BlockHash]) -> None:
        await self.inner.unpin(hashes)

    def stats(self) -> dict[str, object]:
        return self.inner.stats()

    async def close(self) -> None:
        await self.inner.close()
