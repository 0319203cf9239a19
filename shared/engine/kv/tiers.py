"""Tiers: the engine's own cache and the host tier behind it, as the primitives the KV-cache
manager and the store fetches build on; the one place where a block enters or leaves either.

- `pool` (BlockPool: ids, reference counts, the PrefixIndex of cached full blocks) and `cache`
  (KVCache tensors) are the device tier; `host` (HostTier, or None) the host tier.
- Eviction order: plain free blocks first, then cached blocks, least recently used leaf first
  (BlockPool). An evicted cached block goes to the host tier (when there is one) before any
  write can reach it: every allocation goes through `allocate`.
- Every block that enters or leaves a tier passes through `log.entered` / `log.left`.
- One thread, the engine's, uses it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvserve.shared.engine.kv.block_pool import BlockPool
from kvserve.shared.engine.kv.cache import KVCache
from kvserve.shared.engine.kv.events import TierEvent, TierLog
from kvserve.shared.engine.kv.host_tier import HostTier
from kvserve.shared.engine.sequence import BlockId
from kvserve.shared.store.block_data import BlockData
from kvserve.shared.store.hashing import BlockHash


class Tiers:
    def __init__(
        self, cache: KVCache, enable_caching: bool, host_tier_bytes: int | None = None
    ) -> None:
        """`host_tier_bytes` adds a host tier of that many bytes (None: no host tier)."""
        self.cache = cache
        self.pool = BlockPool(cache.num_blocks, enable_caching=enable_caching)
        self.host = HostTier(host_tier_bytes) if host_tier_bytes is not None else None
        self.log = TierLog()
        self.copy_in_s = 0.0  # time spent copying host-tier blocks into the cache

    def allocate(self, n: int) -> list[BlockId] | None:
        """`n` fresh device blocks, or None. Cached blocks evicted to make room leave the
        device tier here, and go to the host tier before anything writes into them."""
        blocks = self.pool.allocate(n)
        evicted = self.pool.take_evicted()
        if evicted:
            self.log.left("device", [h for _, h in evicted])
            self._offload(evicted)
        return blocks

    def _offload(self, evicted: list[tuple[BlockId, BlockHash]]) -> None:
        if self.host is None:
            return
        todo = [(b, h) for b, h in evicted if h not in self.host]
        if todo:
            data = self.cache.read_blocks([b for b, _ in todo])
            for (_, h), d in zip(todo, data, strict=True):
                self.host_put(h, d, "host")

    def cache_on_device(self, parent: BlockId | None, h: BlockHash, block: BlockId) -> bool:
        """Index `block` as holding `h` (after `parent`); False if `h` is indexed already."""
        if self.pool.cache(parent, h, block):
            self.log.entered("device", [h])
            return True
        return False

    def host_put(self, h: BlockHash, data: BlockData, source: str) -> None:
        assert self.host is not None
        fresh = h not in self.host
        evicted = self.host.put(h, data, source)
        if fresh and h in self.host:
            self.log.entered("host", [h])
        self.log.left("host", evicted)

    def host_pin(self, h: BlockHash, data: BlockData) -> None:
        """Keep a warm-up block in the host tier, outside its byte bound."""
        assert self.host is not None
        if h not in self.host:
            self.log.entered("host", [h])
        self.host.pin(h, data, "host")

    def copy_in(
        self, wanted: list[BlockHash], blocks: list[BlockId], sources: dict[str, int]
    ) -> None:
        """Extend `blocks` (a matched device prefix) with the host tier's run of `wanted`,
        copied into fresh blocks and cached there; `sources` counts the tokens by source."""
        if self.host is None:
            return
        run: list[tuple[BlockHash, BlockData, str]] = []
        for h in wanted[: self.pool.num_free]:
            got = self.host.get(h)
            if got is None:
                break
            run.append((h, *got))
        new = self.allocate(len(run)) if run else None
        if not new:
            return
        t0 = time.perf_counter()
        self.cache.write_blocks(new, [d for _, d, _ in run])
        self.copy_in_s += time.perf_counter() - t0
        for (h, _, src), b in zip(run, new, strict=True):
            self.cache_on_device(blocks[-1] if blocks else None, h, b)
            blocks.append(b)
            sources[src] = sources.get(src, 0) + self.cache.block_size

    def hold_prefix(self, hashes: list[BlockHash]) -> list[BlockId]:
        """The longest run of `hashes` the device cache holds, continued from the host tier,
        each block referenced (give them back with `free`)."""
        held = self.pool.match_prefix(hashes)
        if len(held) < len(hashes):
            self.copy_in(hashes[len(held) :], held, {})
        return held

    def local_prefix(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """How many leading blocks of `hashes` the device cache holds, and how many more the
        host tier continues the run with (a lookup: no reference taken, nothing moved)."""
        index = self.pool.index
        device = len(index.match(list(hashes))) if index is not None else 0
        host = 0
        if self.host is not None:
            while device + host < len(hashes) and hashes[device + host] in self.host:
                host += 1
        return device, host

    def free(self, blocks: Sequence[BlockId]) -> None:
        """Drop one reference to each block, tail first (so the tail is reused first)."""
        self.pool.free(reversed(blocks))

    def reset(self) -> dict[str, int]:
        """Drop the device cache's unreferenced blocks and the whole host tier. Returns
        {"device_blocks", "host_blocks"} dropped."""
        dropped = self.pool.drop_cached()
        self.log.left("device", [h for _, h in dropped])
        host = self.host.clear() if self.host is not None else []
        self.log.left("host", host)
        self.log.log(TierEvent("cleared", ""))
        return {"device_blocks": len(dropped), "host_blocks": len(host)}

    def log_snapshot(self, chunk: int = 512) -> None:
        """Log what the device and host tiers hold now, after a "cleared" (engine thread)."""
        device = self.pool.index.hashes() if self.pool.index is not None else []
        host = self.host.hashes() if self.host is not None else []
        self.log.snapshot({"device": device, "host": host}, chunk)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the device prefix index (held or evictable)."""
        return len(self.pool.index) if self.pool.index is not None else 0

    @property
    def num_host_blocks(self) -> int:
        return len(self.host) if self.host is not None else 0
