"""KVCacheManager: every block of KV the engine can reach, in each tier, as the scheduler, the
engine and the workers see it.

Tiers, fastest first: the device cache and the host tier (`tiers`: Tiers, the one place where a
block enters or leaves either), then the store (StoreConnector: encoded frames in a store
backend, written behind, loaded asynchronously straight into device blocks by `fetches`).

Who calls what:
- the Scheduler (through its KVSlots view): `match_prefix(seq)` when it admits a sequence
  with nothing computed, `allocate_slots(seq, n)` before a step, `free(seq)` when it preempts
  or finishes one, `start_fetch` / `take_fetched` / `cancel_fetch` for sequences parked while
  their prefix comes from the store, `publish(seq)` and `observe_prefill` after each step;
- the Engine: `fork` for n > 1 siblings and beams, `tail_of`, `prefix_hashes` / `stored` /
  `pin` for warm-up, `allocate_blocks` / `free_blocks` for scoring, `reset`, `stats`, `close`;
- the workers (through AsyncEngine): `local_prefix` (prefill's prefix-match span), `hand_off`
  (prefill) and `fetch_tail` (decode) for the disaggregated hand-off, `events` and
  `log_snapshot` for KV events.

Invariants:
- A block id is in a sequence's table once per reference the sequence holds; `free(seq)` drops
  them all, tail first (so the tail is reused before the head).
- A block is in the prefix index only when its K/V is in place: it was computed by a step,
  copied in from the host tier at match time, or written by a finished store load.
- Only this package touches the pool, the host tier and the connector; the cache tensors it
  reads and writes whole blocks of (the model writes tokens into them during a step).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from kvserve.shared.config import DEFAULT_STORE, StoreConfig, cache_dir
from kvserve.shared.engine.kv.cache import KVCache, kv_dtype_name
from kvserve.shared.engine.kv.connector import BlockWrite, FetchResult, StoreConnector
from kvserve.shared.engine.kv.events import TierLog
from kvserve.shared.engine.kv.fetches import StoreFetches
from kvserve.shared.engine.kv.host_tier import HostTier
from kvserve.shared.engine.kv.tiers import Tiers
from kvserve.shared.engine.sequence import BlockId, Sequence
from kvserve.shared.store.backends import open_store
from kvserve.shared.store.base import BlockStore
from kvserve.shared.store.block_data import KVTail
from kvserve.shared.store.codec import BlockMeta
from kvserve.shared.store.hashing import BlockHash, block_hashes, root_hash


def store_url(url: str) -> str:
    """``"default"``: the disk tier under the cache directory; anything else as given."""
    return f"file://{cache_dir() / 'store'}" if url == DEFAULT_STORE else url


@dataclass(frozen=True)
class KVIdentity:
    """What makes blocks of two engines interchangeable: the frame header a block carries in
    the store, and the tokenizer. `root_hash` is the chain's root (DESIGN.md section 5)."""

    meta: BlockMeta
    tokenizer_fingerprint: str

    def root_hash(self, cache_salt: str | None = None) -> BlockHash:
        m = self.meta
        return root_hash(
            m.model_fp, self.tokenizer_fingerprint, m.kv_format, m.block_size, cache_salt
        )


class KVCacheManager:
    def __init__(
        self,
        cache: KVCache,
        identity: KVIdentity,
        *,
        enable_caching: bool = True,
        store: StoreConfig | None = None,
        open_backend: Callable[[str], BlockStore] = open_store,
    ) -> None:
        """`store` with a URL (and caching on) adds the host tier and the store connector
        over the backend `open_backend` opens for the URL."""
        self.cache = cache
        self.identity = identity
        self.block_size = cache.block_size
        self.store_config = store
        url = store.url if store is not None and enable_caching else None
        host_bytes = store.host_tier_bytes if url and store is not None else None
        self.tiers = Tiers(cache, enable_caching, host_bytes)
        self.pool = self.tiers.pool
        self.connector: StoreConnector | None = None
        self.fetches: StoreFetches | None = None
        if url and store is not None:
            self.connector = StoreConnector(
                open_backend(store_url(url)),
                identity.meta,
                store.frame_format(kv_dtype_name(cache.dtype)),
                cache.dtype,
                store.write_queue_blocks,
                store.fetch_timeout_s,
            )
            self.fetches = StoreFetches(self.tiers, self.connector)
        # Running estimate of prefill seconds per token, for the store's cost rule.
        self.prefill_s_per_token = 1 / 300
        self.prefill_observed = False  # prefill_s_per_token measured, not the guess above

    @property
    def num_blocks(self) -> int:
        """Blocks in the device cache, used or free."""
        return self.pool.num_blocks

    @property
    def caching(self) -> bool:
        return self.pool.index is not None

    @property
    def has_store(self) -> bool:
        return self.connector is not None

    @property
    def host_tier(self) -> HostTier | None:
        return self.tiers.host

    @property
    def copy_in_s(self) -> float:
        """Seconds spent copying host-tier blocks into the cache (benchmarks)."""
        return self.tiers.copy_in_s

    @property
    def events(self) -> TierLog:
        """The tier changes (counted; logged once `events.enable()` was called)."""
        return self.tiers.log

    def log_snapshot(self, chunk: int = 512) -> None:
        """Log a "cleared", then every block the device and host tiers hold (engine thread)."""
        self.tiers.log_snapshot(chunk)

    def close(self) -> None:
        """Write out queued blocks and close the store; stop the cache's background work."""
        self.cache.close()
        if self.connector is not None:
            self.connector.close()
            self.connector = None
            self.fetches = None

    # ---- the scheduler's side -----------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> None:
        """Attach the longest cached run of the sequence's full blocks: the device cache's,
        then its continuation from the host tier (copied into fresh device blocks and cached
        there), then a disaggregated decode's prompt tail. The last token is always computed
        (its logits are needed), so at most (num_tokens - 1) // block_size blocks match."""
        if not self.caching:
            return
        hashes = seq.matchable_block_hashes(self.block_size)
        limit = len(hashes)
        blocks = self.pool.match_prefix(hashes)
        loaded = sum(h in seq.loaded_from_store for h in hashes[: len(blocks)])
        seq.loaded_from_store = set()
        sources = {"device": (len(blocks) - loaded) * self.block_size}
        if loaded:
            sources["store"] = loaded * self.block_size
        if len(blocks) < limit:
            self.tiers.copy_in(hashes[len(blocks) :], blocks, sources)
        seq.block_table = blocks
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_published = len(blocks)
        if seq.num_preemptions == 0:  # as num_cached_tokens: what the first admission found
            seq.cached_tokens_by_source = sources
        tail, seq.kv_tail = seq.kv_tail, None  # used once: after a preemption, recompute
        if tail is not None and len(blocks) == limit:
            self._attach_tail(seq, tail)

    def _attach_tail(self, seq: Sequence, tail: KVTail) -> None:
        start = seq.num_computed_tokens
        end = start + len(tail.token_ids)
        if end >= seq.num_tokens or seq.token_ids[start:end] != tail.token_ids:
            return
        new = self.tiers.allocate(1)
        if new:
            self.cache.write_blocks(new, [tail.data])
            seq.block_table.append(new[0])
            seq.num_computed_tokens = end
            by_source = seq.cached_tokens_by_source
            by_source["store"] = by_source.get("store", 0) + len(tail.token_ids)

    def allocate_slots(self, seq: Sequence, n: int) -> list[tuple[BlockId, BlockId]] | None:
        """Give `seq` the blocks to write tokens [num_computed, num_computed + n): new blocks,
        plus a private copy of the block it writes first if that one is shared. Returns the
        (src, dst) copies the step must make before its forward pass, or None, changing
        nothing, when the blocks are not there."""
        bs = self.block_size
        first = seq.num_computed_tokens // bs
        cow = first < len(seq.block_table) and self.pool.is_shared(seq.block_table[first])
        new = self.tiers.allocate(seq.blocks_needed(seq.num_computed_tokens + n, bs) + int(cow))
        if new is None:
            return None
        copies = []
        if cow:
            src, dst = seq.block_table[first], new.pop()
            copies.append((src, dst))
            seq.block_table[first] = dst
            self.pool.free([src])
        seq.block_table.extend(new)
        return copies

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references to its blocks, tail first."""
        self.tiers.free(seq.block_table)
        seq.block_table = []
        seq.num_published = 0

    def publish(self, seq: Sequence) -> None:
        """Put the sequence's newly computed full blocks in the prefix index, and queue those
        newly cached for the store (write-behind)."""
        full = seq.num_computed_tokens // self.block_size
        if not self.caching or full <= seq.num_published or seq.root_hash is None:
            return
        hashes = seq.full_block_hashes(full, self.block_size)
        fresh: list[int] = []
        for i in range(seq.num_published, full):
            parent = seq.block_table[i - 1] if i else None
            if self.tiers.cache_on_device(parent, hashes[i], seq.block_table[i]):
                fresh.append(i)
        seq.num_published = full
        if self.connector is not None and fresh:
            data = self.cache.read_blocks([seq.block_table[i] for i in fresh])
            bs, root = self.block_size, seq.root_hash
            self._store_put(
                BlockWrite(hashes[i], hashes[i - 1] if i else root,
                           seq.token_ids[i * bs : (i + 1) * bs], d, i == 0)
                for i, d in zip(fresh, data, strict=True)
            )  # fmt: skip

    def _store_put(self, writes: Iterable[BlockWrite]) -> None:
        assert self.connector is not None
        self.events.entered("store", self.connector.publish(list(writes)))

    def observe_prefill(self, prompt_tokens: int, step_tokens: int, seconds: float) -> None:
        """Update the prefill-speed estimate from steps that are mostly prompt tokens."""
        if prompt_tokens >= 64 and prompt_tokens >= step_tokens // 2:
            self.prefill_observed = True
            self.prefill_s_per_token = 0.7 * self.prefill_s_per_token + 0.3 * (
                seconds / step_tokens
            )

    def store_load_cost(self) -> float | None:
        """A block loaded from the store as a fraction of recomputing it (at most 1), by the
        running estimates the fetch rule weighs; None without a store, or until both have
        been measured (the starting guesses are not this machine's). Workers report it, and
        the router's store cost "auto" values a store-held block by it."""
        if self.connector is None or not self.prefill_observed:
            return None
        if not self.connector.counters["fetched_blocks"]:
            return None
        recompute_s = self.prefill_s_per_token * self.block_size
        return min(1.0, self.connector.fetch_s_per_block / recompute_s)

    def start_fetch(self, seq: Sequence) -> bool:
        """Ask the store for the prompt's blocks that the local tiers lack; the sequence stays
        parked until `take_fetched` returns it. False when there is nothing to ask for."""
        if self.fetches is None:
            return False
        return self.fetches.start(seq, self.prefill_s_per_token * self.block_size)

    def take_fetched(self, wait: bool) -> list[Sequence]:
        """Parked sequences whose blocks are now in the device cache (or whose lookup ended
        without them); with `wait`, wait briefly for one."""
        return self.fetches.take_done(wait) if self.fetches is not None else []

    def cancel_fetch(self, request_id: str) -> None:
        if self.fetches is not None:
            self.fetches.cancel(request_id)

    def flush(self) -> bool:
        """Wait until every block queued for the store is written (True without a store)."""
        return self.connector.flush() if self.connector is not None else True

    def cached_block(self, h: BlockHash) -> BlockId | None:
        """The device block that holds `h` in the prefix index (None: not cached)."""
        return self.pool.index.block_of(h) if self.pool.index is not None else None

    @property
    def last_fetch(self) -> FetchResult | None:
        """The latest finished store lookup (benchmarks)."""
        return self.fetches.last if self.fetches is not None else None

    # ---- the engine's side --------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (copy-on-write on the next write)."""
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.cached_tokens_by_source = dict(parent.cached_tokens_by_source)
        child.store_lookup = parent.store_lookup
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_published = parent.num_published
        self.pool.share(child.block_table)

    def allocate_blocks(self, n: int) -> list[BlockId] | None:
        """`n` blocks outside any sequence (scoring); give them back with `free_blocks`."""
        return self.tiers.allocate(n)

    def free_blocks(self, blocks: Seq[BlockId]) -> None:
        self.tiers.free(blocks)

    def local_prefix(self, hashes: Seq[BlockHash]) -> tuple[int, int]:
        """How many leading blocks of `hashes` the device cache holds, and how many more the
        host tier continues the run with (a lookup: no reference taken, nothing moved)."""
        return self.tiers.local_prefix(hashes)

    def hand_off(self, request_id: str, tail: KVTail | None) -> bool:
        """Prefill's side of a disaggregated request: the prompt's tail under the request's
        key, then every queued block written out (blocking). False without a store or when
        the writes did not finish."""
        if self.connector is None:
            return False
        if tail is not None:
            self.connector.put_tail(request_id, tail)
        return bool(self.connector.flush())

    def fetch_tail(
        self, request_id: str, token_ids: list[int]
    ) -> concurrent.futures.Future[KVTail | None] | None:
        """Decode's side: the tail prefill stored for this request (None: no store)."""
        if self.connector is None:
            return None
        return self.connector.get_tail(request_id, token_ids)

    def tail_of(self, seq: Sequence) -> KVTail | None:
        """The prompt's partial last block (None when the prompt is whole blocks)."""
        bs = self.block_size
        full = seq.num_prompt_tokens // bs
        if seq.num_prompt_tokens == full * bs or len(seq.block_table) <= full:
            return None
        (data,) = self.cache.read_blocks([seq.block_table[full]])
        return KVTail(seq.token_ids[full * bs : seq.num_prompt_tokens], data)

    # ---- warm-up, reset, stats ----------------------------------------------------------------

    def prefix_hashes(self, prefix: Seq[int], cache_salt: str | None) -> list[BlockHash]:
        """The chained hashes of the prefix's full blocks under the salt's root."""
        n = len(prefix) // self.block_size
        root = self.identity.root_hash(cache_salt)
        return block_hashes(root, list(prefix[: n * self.block_size]), self.block_size)

    def stored(self, hashes: Seq[BlockHash]) -> list[bool]:
        """Which of the blocks the store holds (blocking; warm-up jobs only)."""
        assert self.connector is not None
        return self.connector.contains(hashes)

    def pin(self, prefix: Seq[int], hashes: list[BlockHash], cache_salt: str | None) -> int:
        """Pin a warmed prefix: its device-cached blocks into the host tier (never evicted)
        and the store (publishing what the store lacks, then pinning all). Returns how many
        blocks were published."""
        assert self.connector is not None and self.pool.index is not None
        self.connector.flush()
        stored = self.connector.contains(hashes)
        on_device = [(i, self.pool.index.block_of(h)) for i, h in enumerate(hashes)]
        found = [(i, b) for i, b in on_device if b is not None]
        read = self.cache.read_blocks([b for _, b in found])
        root = self.identity.root_hash(cache_salt)
        bs, writes = self.block_size, []
        for (i, _), data in zip(found, read, strict=True):
            self.tiers.host_pin(hashes[i], data)
            if not stored[i]:
                tokens = list(prefix[i * bs : (i + 1) * bs])
                writes.append(
                    BlockWrite(hashes[i], hashes[i - 1] if i else root, tokens, data, i == 0)
                )
        self._store_put(writes)
        published = len(writes)
        self.connector.flush()
        self.connector.pin(hashes)
        return published

    def reset(self) -> dict[str, int]:
        """Drop the device prefix cache's unreferenced blocks and the whole host tier (like
        vLLM's reset_prefix_cache); blocks running requests hold, and the store, stay.
        Returns {"device_blocks", "host_blocks"} dropped."""
        return self.tiers.reset()

    def stats(self) -> dict[str, Any]:
        """Block counts of each tier and the tier events (`{tier}_{stored|removed}`)."""
        counts = self.events.counts
        return {
            "num_blocks": self.pool.num_blocks,
            "num_used_blocks": self.pool.num_used,
            "kv_cache_usage_perc": self.pool.usage,
            "cached_blocks": self.tiers.num_cached_blocks,
            "evicted_blocks": self.pool.num_evicted,
            "host_tier_blocks": self.tiers.num_host_blocks,
            "tier_events": {f"{t}_{k}": n for (t, k), n in sorted(counts.items())},
        }

    def store_stats(self) -> dict[str, object]:
        """The connector's counters (decisions, published, dropped, miss reasons) and the
        store backend's; empty without a store."""
        return self.connector.stats() if self.connector is not None else {}

    def store_latency(self) -> dict[str, Any]:
        """The store calls' latency histograms (empty without a store)."""
        return self.connector.latency.snapshot() if self.connector is not None else {}
