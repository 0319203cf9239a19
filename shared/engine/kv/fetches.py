"""StoreFetches: the store lookups of sequences parked while their prefix blocks come from the
store, from the first question to the blocks written into the device cache.

Invariants:
- A lookup has two stages on the store's thread: `fetch` (which blocks the store holds; the
  cost rule) and, when it chose to load, `load` straight into device blocks that
  `_begin_load` allocated after taking the local prefix (device cache, then host tier) and
  holding it. `_end_load` indexes the blocks the load wrote, chained after that prefix, and
  lets go of the rest.
- A block is in the prefix index only when its K/V is in place: a load's blocks are indexed
  only once the load finished, and only its verified leading run.
- Blocks of a load that was stopped (abort, overrun) go back to the pool only once its worker
  threads can no longer write (LoadJob.quiescent).
- At most one lookup per request id; every stage ends by its deadline.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

from kvserve.shared.engine.kv.connector import FetchResult, StoreConnector
from kvserve.shared.engine.kv.load import Chain, LoadJob
from kvserve.shared.engine.kv.tiers import Tiers
from kvserve.shared.engine.sequence import BlockId, Sequence

log = logging.getLogger("kvserve.engine")


@dataclass
class _Fetch:
    """A parked sequence's lookup: first the question (`job` None), then the load straight
    into `dst`, the blocks after `held` (the local prefix, referenced meanwhile so that
    nothing evicts it)."""

    future: concurrent.futures.Future[FetchResult]
    seq: Sequence
    deadline: float
    start: int  # the first full block the lookup asked for
    started: float = field(default_factory=time.perf_counter)
    job: LoadJob | None = None
    held: list[BlockId] = field(default_factory=list)
    dst: list[BlockId] = field(default_factory=list)


class StoreFetches:
    def __init__(self, tiers: Tiers, connector: StoreConnector) -> None:
        self.tiers = tiers
        self.connector = connector
        self.block_size = tiers.cache.block_size
        self._fetching: dict[str, _Fetch] = {}
        # Blocks of loads that were stopped, until their last write has finished.
        self._draining: list[tuple[LoadJob, list[BlockId]]] = []
        self.last: FetchResult | None = None  # the latest finished fetch (benchmarks)

    def start(self, seq: Sequence, recompute_s_per_block: float) -> bool:
        """Ask the store for the full prompt blocks that neither the device cache nor the host
        tier holds (they must continue the locally held run). False when there is nothing to
        ask for."""
        if self.tiers.pool.index is None or seq.root_hash is None:
            return False
        hashes = seq.matchable_block_hashes(self.block_size)
        start = sum(self.tiers.local_prefix(hashes))
        if start >= len(hashes):
            return False
        fut = self.connector.fetch(hashes[start:], seq.root_hash, recompute_s_per_block)
        deadline = time.monotonic() + self.connector.fetch_timeout_s + 1.0
        self._fetching[seq.request_id] = _Fetch(fut, seq, deadline, start)
        return True

    def take_done(self, wait: bool) -> list[Sequence]:
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
            self._finish(rid, f, res)
            done.append(f.seq)
        return done

    def _finish(self, rid: str, f: _Fetch, res: FetchResult) -> None:
        self._end_load(f, res)
        res.timings["admitted_after_s"] = time.perf_counter() - f.started
        self.last = res
        f.seq.store_lookup = res.outcome
        if res.decision != "none":
            log.info(
                "request %s: store %s, %d of %d blocks loaded",
                rid,
                res.decision,
                res.loaded,
                res.present,
            )

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
        assert f.seq.root_hash is not None
        tiers = self.tiers
        hashes = f.seq.matchable_block_hashes(self.block_size)
        held = tiers.hold_prefix(hashes)
        n = min(f.start + res.present - len(held), tiers.pool.num_free)
        dst = tiers.allocate(n) if len(held) >= f.start and n > 0 else None
        if not dst:
            tiers.free(held)
            self.connector.abandon(res)
            res.decision, res.outcome = "recompute", "recompute"
            return False
        f.held, f.dst, f.job = held, dst, LoadJob()
        first = len(held)
        want = hashes[first : first + len(dst)]
        parent = hashes[first - 1] if first else f.seq.root_hash
        chain = Chain.of_run(f.seq.token_ids, self.block_size, first, parent, want)
        cache = tiers.cache
        f.future = self.connector.load(
            res, want, f.seq.root_hash, dst, cache.write_stacked, f.job, cache.write_frames, chain,
            cache.write_templated,
        )  # fmt: skip
        f.deadline = time.monotonic() + self.connector.fetch_timeout_s + 1.0
        return True

    def _end_load(self, f: _Fetch, res: FetchResult) -> None:
        """Cache the blocks the load wrote (chained after the held prefix) and let go of
        everything else: blocks a stopped load may still write wait until it is quiet."""
        if f.job is None:
            return
        f.job.stop()
        hashes = f.seq.matchable_block_hashes(self.block_size)
        index = self.tiers.pool.index
        parent = f.held[-1] if f.held else None
        first = len(f.held)
        for i in range(res.loaded if f.future.done() else 0):
            h = hashes[first + i]
            self.tiers.cache_on_device(parent, h, f.dst[i])
            parent = index.block_of(h) if index is not None else None
            if parent is None:
                break
            f.seq.loaded_from_store.add(h)
        self.tiers.free(f.held)
        if f.job.quiescent():
            self.tiers.free(f.dst)
        else:
            self._draining.append((f.job, f.dst))
        f.job, f.held, f.dst = None, [], []

    def _free_drained(self) -> None:
        if self._draining:
            quiet = [d for d in self._draining if d[0].quiescent()]
            for job, dst in quiet:
                self.tiers.free(dst)
                self._draining.remove((job, dst))

    def cancel(self, request_id: str) -> None:
        fetch = self._fetching.pop(request_id, None)
        if fetch is not None:
            fetch.future.cancel()
            self._end_load(fetch, FetchResult())
