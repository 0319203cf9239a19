"""KVCacheManager: every block of KV the engine can reach, in each tier, and the one place where a
block enters or leaves a tier.

Tiers, fastest first: the device cache (KVCache tensors; BlockPool ids, reference counts and the
PrefixIndex of cached full blocks), the host tier (HostTier: BlockData in host RAM) and the store
(StoreConnector: encoded frames in a store backend, written behind, loaded asynchronously
straight into device blocks).

Who calls what:
- the Scheduler: `match_prefix(seq)` when it admits a sequence with nothing computed,
  `allocate_slots(seq, n)` before a step, `free(seq)` when it preempts or finishes one;
- the Engine: `publish(seq)` after each step, `start_fetch` / `take_fetched` / `cancel_fetch`
  around a request's arrival, `fork` for n > 1 siblings and beams, `tail_of`, `prefix_hashes` /
  `stored` / `pin` for warm-up, `reset`, `stats`, `close`;
- the workers: `local_prefix` (prefill's prefix-match span), `hand_off` (prefill) and
  `fetch_tail` (decode) for the disaggregated handoff.

Invariants:
- A block id is in a sequence's table once per reference the sequence holds; `free(seq)` drops
  them all, tail first (so the tail is reused before the head).
- A block is in the prefix index only when its K/V is in place: it was computed by a step,
  copied in from the host tier at match time, or written by a finished store load.
- A store lookup has two stages on the store's thread: `fetch` (which blocks the store holds;
  the cost rule) and, when it chose to load, `load` straight into device blocks that
  `_begin_load` allocated after taking the local prefix (device cache, then host tier) and
  holding it. `_end_load` indexes the blocks the load wrote, chained after that prefix, and
  lets go of the rest; blocks of a load that was stopped (abort, overrun) go back to the pool
  only once its worker threads can no longer write (LoadJob.quiescent).
- Eviction order: plain free blocks first, then cached blocks, least recently used leaf first
  (BlockPool). An evicted cached block goes to the host tier (when there is one) before any
  write can reach it: every allocation goes through `_allocate`.
- Every block that enters or leaves a tier passes through `_entered` / `_left`, which count it
  by (tier, kind) in `tier_events` (reported by `stats`) and, once `enable_events()` was called,
  log it as a TierEvent for `take_events()` (a worker publishes them as KV events for routers;
  `reset` logs one "cleared"; `log_snapshot` logs "cleared" and then every block the device and
  host tiers hold, for a reader that lost track). The log is a deque: the engine thread
  appends, the worker's event loop takes; past `max_events` unread it is replaced by a single
  "cleared" (readers forget this engine's blocks rather than keep a wrong picture).
- Only this class touches the pool, the host tier and the connector; the cache tensors it reads
  and writes whole blocks of (the model writes tokens into them during a step).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import Counter, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from kvserve.shared.config import DEFAULT_STORE, StoreConfig, cache_dir
from kvserve.shared.engine.block_pool import BlockPool
from kvserve.shared.engine.kv_cache import KVCache
from kvserve.shared.engine.sequence import BlockId, Sequence
from kvserve.shared.store.base import open_store
from kvserve.shared.store.block_data import BlockData
from kvserve.shared.store.codec import BlockMeta
from kvserve.shared.store.hashing import BlockHash, block_hashes, root_hash
from kvserve.shared.store.tiers import FetchResult, HostTier, KVTail, LoadJob, StoreConnector

log = logging.getLogger("kvserve.engine")

TIERS = ("device", "host", "store")


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


@dataclass(frozen=True)
class TierEvent:
    """Blocks that entered ("stored") or left ("removed") a tier, or "cleared" (the device and
    host tiers dropped everything unreferenced)."""

    kind: str
    tier: str
    hashes: tuple[BlockHash, ...] = ()


@dataclass
class _Fetch:
    """A sequence parked while its prefix blocks come from the store: first the lookup
    (`job` None), then the load straight into `dst`, the blocks after `held` (the local
    prefix, referenced meanwhile so that nothing evicts it)."""

    future: concurrent.futures.Future[FetchResult]
    seq: Sequence
    deadline: float
    start: int  # the first full block the lookup asked for
    started: float = field(default_factory=time.perf_counter)
    job: LoadJob | None = None
    held: list[BlockId] = field(default_factory=list)
    dst: list[BlockId] = field(default_factory=list)


class KVCacheManager:
    def __init__(
        self,
        cache: KVCache,
        identity: KVIdentity,
        *,
        enable_caching: bool = True,
        store: StoreConfig | None = None,
    ) -> None:
        """`store` with a URL (and caching on) adds the host tier and the store connector."""
        self.cache = cache
        self.identity = identity
        self.block_size = cache.block_size
        self.pool = BlockPool(cache.num_blocks, enable_caching=enable_caching)
        self.host_tier: HostTier | None = None
        self.connector: StoreConnector | None = None
        self.store_config = store
        if store is not None and store.url and enable_caching:
            self.host_tier = HostTier(store.host_tier_bytes)
            self.connector = StoreConnector(
                open_store(store_url(store.url)),
                identity.meta,
                store.frame_format,
                cache.dtype,
                store.write_queue_blocks,
                store.fetch_timeout_s,
            )
        self.tier_events: Counter[tuple[str, str]] = Counter()
        self._events: deque[TierEvent] | None = None
        self.max_events = 100_000
        self._fetching: dict[str, _Fetch] = {}
        # Blocks of loads that were stopped, until their last write has finished.
        self._draining: list[tuple[LoadJob, list[BlockId]]] = []
        # Running estimate of prefill seconds per token, for the store's cost rule.
        self.prefill_s_per_token = 1 / 300
        self.last_fetch: FetchResult | None = None  # the latest finished fetch (benchmarks)
        self.copy_in_s = 0.0  # time spent copying host-tier blocks into the cache

    @property
    def caching(self) -> bool:
        return self.pool.index is not None

    def close(self) -> None:
        """Write out queued blocks and close the store; stop the cache's background work."""
        self.cache.close()
        if self.connector is not None:
            self.connector.close()
            self.connector = None

    # ---- where blocks enter and leave tiers ---------------------------------------------------

    def enable_events(self) -> None:
        """Log every tier change from now on, for `take_events`."""
        if self._events is None:
            self._events = deque()

    def take_events(self) -> list[TierEvent]:
        """The tier changes logged since the previous call, oldest first (any thread)."""
        out: list[TierEvent] = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def log_snapshot(self, chunk: int = 512) -> None:
        """Log what the device and host tiers hold now, after a "cleared" (engine thread)."""
        self._log(TierEvent("cleared", ""))
        device = self.pool.index.hashes() if self.pool.index is not None else []
        host = self.host_tier.hashes() if self.host_tier is not None else []
        for tier, hashes in (("device", device), ("host", host)):
            for i in range(0, len(hashes), chunk):
                self._log(TierEvent("stored", tier, tuple(hashes[i : i + chunk])))

    def _log(self, event: TierEvent) -> None:
        if self._events is None:
            return
        if len(self._events) >= self.max_events:
            self._events.clear()
            event = TierEvent("cleared", "")
        self._events.append(event)

    def _entered(self, tier: str, hashes: Seq[BlockHash]) -> None:
        if hashes:
            self.tier_events[(tier, "stored")] += len(hashes)
            self._log(TierEvent("stored", tier, tuple(hashes)))

    def _left(self, tier: str, hashes: Seq[BlockHash]) -> None:
        if hashes:
            self.tier_events[(tier, "removed")] += len(hashes)
            self._log(TierEvent("removed", tier, tuple(hashes)))

    def _allocate(self, n: int) -> list[BlockId] | None:
        """`n` fresh device blocks, or None. Cached blocks evicted to make room leave the
        device tier here, and go to the host tier before anything writes into them."""
        blocks = self.pool.allocate(n)
        evicted = self.pool.take_evicted()
        if evicted:
            self._left("device", [h for _, h in evicted])
            self._offload(evicted)
        return blocks

    def _offload(self, evicted: list[tuple[BlockId, BlockHash]]) -> None:
        if self.host_tier is None:
            return
        todo = [(b, h) for b, h in evicted if h not in self.host_tier]
        if todo:
            data = self.cache.read_blocks([b for b, _ in todo])
            for (_, h), d in zip(todo, data, strict=True):
                self._host_put(h, d, "host")

    def _cache_on_device(self, parent: BlockId | None, h: BlockHash, block: BlockId) -> bool:
        if self.pool.cache(parent, h, block):
            self._entered("device", [h])
            return True
        return False

    def _host_put(self, h: BlockHash, data: BlockData, source: str) -> None:
        assert self.host_tier is not None
        fresh = h not in self.host_tier
        evicted = self.host_tier.put(h, data, source)
        if fresh and h in self.host_tier:
            self._entered("host", [h])
        self._left("host", evicted)

    # ---- the scheduler's side -----------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> None:
        """Attach the longest cached run of the sequence's full blocks: the device cache's,
        then its continuation from the host tier (copied into fresh device blocks and cached
        there), then a disaggregated decode's prompt tail. The last token is always computed
        (its logits are needed), so at most (num_tokens - 1) // block_size blocks match."""
        if not self.caching:
            return
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = seq.full_block_hashes(limit, self.block_size)
        blocks = self.pool.match_prefix(hashes)
        loaded = sum(h in seq.loaded_from_store for h in hashes[: len(blocks)])
        seq.loaded_from_store = set()
        sources = {"device": (len(blocks) - loaded) * self.block_size}
        if loaded:
            sources["store"] = loaded * self.block_size
        if self.host_tier is not None and len(blocks) < limit:
            self._copy_in(hashes[len(blocks) :], blocks, sources)
        seq.block_table = blocks
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_published = len(blocks)
        if seq.num_preemptions == 0:  # as num_cached_tokens: what the first admission found
            seq.cached_tokens_by_source = sources
        tail, seq.kv_tail = seq.kv_tail, None  # used once: after a preemption, recompute
        if tail is not None and len(blocks) == limit:
            self._attach_tail(seq, tail)

    def _copy_in(
        self, wanted: list[BlockHash], blocks: list[BlockId], sources: dict[str, int]
    ) -> None:
        """Extend `blocks` with the host tier's run of `wanted`, copied into fresh blocks."""
        assert self.host_tier is not None
        run: list[tuple[BlockHash, BlockData, str]] = []
        for h in wanted[: self.pool.num_free]:
            got = self.host_tier.get(h)
            if got is None:
                break
            run.append((h, *got))
        new = self._allocate(len(run)) if run else None
        if not new:
            return
        t0 = time.perf_counter()
        self.cache.write_blocks(new, [d for _, d, _ in run])
        self.copy_in_s += time.perf_counter() - t0
        for (h, _, src), b in zip(run, new, strict=True):
            self._cache_on_device(blocks[-1] if blocks else None, h, b)
            blocks.append(b)
            sources[src] = sources.get(src, 0) + self.block_size

    def _attach_tail(self, seq: Sequence, tail: KVTail) -> None:
        start = seq.num_computed_tokens
        end = start + len(tail.token_ids)
        if end >= seq.num_tokens or seq.token_ids[start:end] != tail.token_ids:
            return
        new = self._allocate(1)
        if new:
            self.cache.write_blocks(new, [tail.data])
            seq.block_table.append(new[0])
            seq.num_computed_tokens = end
            seq.cached_tokens_by_source["store"] = seq.cached_tokens_by_source.get(
                "store", 0
            ) + len(tail.token_ids)

    def allocate_slots(self, seq: Sequence, n: int) -> list[tuple[BlockId, BlockId]] | None:
        """Give `seq` the blocks to write tokens [num_computed, num_computed + n): new blocks,
        plus a private copy of the block it writes first if that one is shared. Returns the
        (src, dst) copies the step must make before its forward pass, or None, changing
        nothing, when the blocks are not there."""
        bs = self.block_size
        first = seq.num_computed_tokens // bs
        cow = first < len(seq.block_table) and self.pool.is_shared(seq.block_table[first])
        new = self._allocate(seq.blocks_needed(seq.num_computed_tokens + n, bs) + int(cow))
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
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_published = 0

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
        return self._allocate(n)

    def free_blocks(self, blocks: Seq[BlockId]) -> None:
        self.pool.free(reversed(blocks))

    # ---- the engine's side --------------------------------------------------------------------

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
            if self._cache_on_device(parent, hashes[i], seq.block_table[i]):
                fresh.append(i)
        seq.num_published = full
        if self.connector is not None and fresh:
            data = self.cache.read_blocks([seq.block_table[i] for i in fresh])
            for i, d in zip(fresh, data, strict=True):
                self._store_put(seq, hashes, i, d)

    def _store_put(self, seq: Sequence, hashes: list[BlockHash], i: int, data: BlockData) -> None:
        assert self.connector is not None and seq.root_hash is not None
        bs = self.block_size
        parent = hashes[i - 1] if i else seq.root_hash
        tokens = seq.token_ids[i * bs : (i + 1) * bs]
        if self.connector.publish(hashes[i], parent, tokens, data, first=i == 0):
            self._entered("store", [hashes[i]])

    def observe_prefill(self, prompt_tokens: int, step_tokens: int, seconds: float) -> None:
        """Update the prefill-speed estimate from steps that are mostly prompt tokens."""
        if prompt_tokens >= 64 and prompt_tokens >= step_tokens // 2:
            self.prefill_s_per_token = 0.7 * self.prefill_s_per_token + 0.3 * (
                seconds / step_tokens
            )

    def start_fetch(self, seq: Sequence) -> bool:
        """Ask the store for the full prompt blocks that neither the device cache nor the host
        tier holds (they must continue the locally held run) and park the sequence until they
        land (`take_fetched`). False when there is nothing to ask for."""
        if self.connector is None or self.pool.index is None or seq.root_hash is None:
            return False
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = seq.full_block_hashes(limit, self.block_size)
        start = sum(self.local_prefix(hashes))
        if start >= limit:
            return False
        recompute_s = self.prefill_s_per_token * self.block_size
        fut = self.connector.fetch(hashes[start:], seq.root_hash, recompute_s)
        timeout = self.connector.fetch_timeout_s + 1.0
        self._fetching[seq.request_id] = _Fetch(fut, seq, time.monotonic() + timeout, start)
        return True

    def local_prefix(self, hashes: Seq[BlockHash]) -> tuple[int, int]:
        """How many leading blocks of `hashes` the device cache holds, and how many more the
        host tier continues the run with (a lookup: no reference taken, nothing moved)."""
        device = len(self.pool.index.match(list(hashes))) if self.pool.index is not None else 0
        host = 0
        if self.host_tier is not None:
            while device + host < len(hashes) and hashes[device + host] in self.host_tier:
                host += 1
        return device, host

    def take_fetched(self, wait: bool) -> list[Sequence]:
        """Sequences whose lookup, and load, have finished (or overrun): their blocks are in
        the device cache. With `wait` (the engine has nothing else to do) wait briefly for
        one. A lookup that chose to load starts the load here."""
        self._free_drained()
        if not self._fetching:
            return []
        if wait:
            concurrent.futures.wait(
                [f.future for f in self._fetching.values()],
                timeout=0.05,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        now = time.monotonic()
        done = []
        for rid, f in list(self._fetching.items()):
            if not (f.future.done() or now >= f.deadline):
                continue
            res = self._result(f)
            if f.job is None and res.decision == "load" and self._begin_load(f, res):
                continue  # the load runs; the sequence stays parked
            del self._fetching[rid]
            self._end_load(f, res)
            res.timings["admitted_after_s"] = time.perf_counter() - f.started
            self.last_fetch = res
            f.seq.store_lookup = res.outcome
            if res.decision != "none":
                log.info(
                    "request %s: store %s, %d of %d blocks loaded",
                    rid,
                    res.decision,
                    res.loaded,
                    res.present,
                )
            done.append(f.seq)
        return done

    def _result(self, f: _Fetch) -> FetchResult:
        """The finished stage's result; an overrun stage is cancelled (a timeout), a failed
        one is "unavailable"."""
        if not f.future.done() or f.future.cancelled():
            f.future.cancel()
            return FetchResult(decision="timeout", outcome="timeout")
        if f.future.exception() is not None:
            return FetchResult(outcome="unavailable")  # the store call raised
        return f.future.result()

    def _begin_load(self, f: _Fetch, res: FetchResult) -> bool:
        """Take the local prefix (device cache, then host tier) and fresh blocks for the
        stored run after it, and start the load into them. False (counted) when the local
        prefix no longer leads into the stored run, or no block is free."""
        assert self.connector is not None and f.seq.root_hash is not None
        limit = (f.seq.num_tokens - 1) // self.block_size
        hashes = f.seq.full_block_hashes(limit, self.block_size)
        held = self.pool.match_prefix(hashes)
        if self.host_tier is not None and len(held) < limit:
            self._copy_in(hashes[len(held) :], held, {})
        end = f.start + res.present
        n = min(end - len(held), self.pool.num_free)
        dst = self._allocate(n) if len(held) >= f.start and n > 0 else None
        if not dst:
            self.pool.free(reversed(held))
            self.connector.abandon(res)
            res.decision, res.outcome = "recompute", "recompute"
            return False
        f.held, f.dst, f.job = held, dst, LoadJob()
        want = hashes[len(held) : len(held) + len(dst)]
        f.future = self.connector.load(
            res, want, f.seq.root_hash, dst, self.cache.write_stacked, f.job
        )
        f.deadline = time.monotonic() + self.connector.fetch_timeout_s + 1.0
        return True

    def _end_load(self, f: _Fetch, res: FetchResult) -> None:
        """Cache the blocks the load wrote (chained after the held prefix) and let go of
        everything else: blocks a stopped load may still write wait until it is quiet."""
        if f.job is None:
            return
        f.job.stop()
        limit = (f.seq.num_tokens - 1) // self.block_size
        hashes = f.seq.full_block_hashes(limit, self.block_size)
        parent = f.held[-1] if f.held else None
        first = len(f.held)
        for i in range(res.loaded if f.future.done() else 0):
            h = hashes[first + i]
            self._cache_on_device(parent, h, f.dst[i])
            parent = self.pool.index.block_of(h) if self.pool.index is not None else None
            if parent is None:
                break
            f.seq.loaded_from_store.add(h)
        self.pool.free(reversed(f.held))
        if f.job.quiescent():
            self.pool.free(reversed(f.dst))
        else:
            self._draining.append((f.job, f.dst))
        f.job, f.held, f.dst = None, [], []

    def _free_drained(self) -> None:
        if self._draining:
            quiet = [d for d in self._draining if d[0].quiescent()]
            for job, dst in quiet:
                self.pool.free(reversed(dst))
                self._draining.remove((job, dst))

    def cancel_fetch(self, request_id: str) -> None:
        fetch = self._fetching.pop(request_id, None)
        if fetch is not None:
            fetch.future.cancel()
            self._end_load(fetch, FetchResult())

    @property
    def has_store(self) -> bool:
        return self.connector is not None

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
        assert self.connector is not None and self.host_tier is not None
        assert self.pool.index is not None
        self.connector.flush()
        stored = self.connector.contains(hashes)
        on_device = [(i, self.pool.index.block_of(h)) for i, h in enumerate(hashes)]
        found = [(i, b) for i, b in on_device if b is not None]
        read = self.cache.read_blocks([b for _, b in found])
        root = self.identity.root_hash(cache_salt)
        bs, published = self.block_size, 0
        for (i, _), data in zip(found, read, strict=True):
            if hashes[i] not in self.host_tier:
                self._entered("host", [hashes[i]])
            self.host_tier.pin(hashes[i], data, "host")
            if not stored[i]:
                parent = hashes[i - 1] if i else root
                tokens = list(prefix[i * bs : (i + 1) * bs])
                if self.connector.publish(hashes[i], parent, tokens, data, first=i == 0):
                    self._entered("store", [hashes[i]])
                published += 1
        self.connector.flush()
        self.connector.pin(hashes)
        return published

    def reset(self) -> dict[str, int]:
        """Drop the device prefix cache's unreferenced blocks and the whole host tier (like
        vLLM's reset_prefix_cache); blocks running requests hold, and the store, stay.
        Returns {"device_blocks", "host_blocks"} dropped."""
        dropped = self.pool.drop_cached()
        self._left("device", [h for _, h in dropped])
        host = self.host_tier.clear() if self.host_tier is not None else []
        self._left("host", host)
        self._log(TierEvent("cleared", ""))
        return {"device_blocks": len(dropped), "host_blocks": len(host)}

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the device prefix index (held or evictable)."""
        return len(self.pool.index) if self.pool.index is not None else 0

    @property
    def num_host_blocks(self) -> int:
        return len(self.host_tier) if self.host_tier is not None else 0

    def stats(self) -> dict[str, Any]:
        """Block counts of each tier and the tier events (`{tier}_{stored|removed}`)."""
        return {
            "num_blocks": self.pool.num_blocks,
            "num_used_blocks": self.pool.num_used,
            "kv_cache_usage_perc": self.pool.usage,
            "cached_blocks": self.num_cached_blocks,
            "evicted_blocks": self.pool.num_evicted,
            "host_tier_blocks": self.num_host_blocks,
            "tier_events": {f"{t}_{k}": n for (t, k), n in sorted(self.tier_events.items())},
        }

    def store_stats(self) -> dict[str, object]:
        """The connector's counters (decisions, published, dropped, miss reasons) and the
        store backend's; empty without a store."""
        return self.connector.stats() if self.connector is not None else {}
