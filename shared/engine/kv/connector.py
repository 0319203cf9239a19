"""StoreConnector: moves blocks between the engine and a store backend without ever blocking an
engine step.

Invariants:
- it owns one thread running an asyncio loop; every store call runs there. The engine thread
  only enqueues writes (`publish`) and starts lookups (`fetch`, then `load`, concurrent
  Futures); it never waits on the store.
- Write-behind: `publish` puts a block on a bounded queue and returns at once; when the queue is
  full the block is dropped and counted (`dropped_writes`). A writer task drains the queue in
  batches, encodes each block (codec, in a worker thread) and calls `put_many`.
- A lookup first asks which of the wanted blocks the store holds (`fetch`: one round trip),
  then applies the cost rule to the leading run of present blocks: load them only when the run
  is at least MIN_FETCH_BLOCKS long and the estimated load time (round trip + per-block
  transfer and decode, both running averages of what loads really took) is below the
  estimated time to recompute them (the caller's prefill seconds per block). Every decision is
  counted and logged.
- A load (`load`) gets the run in batches of FETCH_BATCH, all of them asked at once (so that
  they arrive one after the other); each batch is verified as soon as it arrives, gathered
  as stored into a staging buffer and written into the engine's device blocks with one copy
  per layer (or one C++ call), an int8 / fp8 frame as a copy of its bytes into a cache of
  its own format or dequantized into a float one (load.BatchLoader, under a LoadJob: once
  stopped, no write starts). A frame that fails to decode (any codec Miss: corrupt,
  wrong model or format, hash mismatch) ends the run there, is counted by reason and deleted
  from the store; `loaded` counts only the verified leading run.
- Every stage finishes within `fetch_timeout_s` (then nothing is loaded: recompute).
- Every lookup ends in one counted outcome (`lookups`, FetchResult.outcome): `hit` (every
  present block loaded), `absent` (the store holds none of them), `recompute` (the cost rule
  chose to recompute), `timeout`, `evicted` (a block went between `contains` and `get`),
  `corrupt` (a frame that does not verify), `wrong_identity` (a frame of another model, format,
  shape or chain), `unavailable` (the store call failed), `recompute` too when the engine had no
  room for the load (`abandon`), `breaker_open` (the store's circuit
  breaker was open for the first wanted block, so the store was not asked: Presence).
- A disaggregated hand-off's tail (`put_tail`) lives TAIL_TTL_S seconds in a store with expiry
  (Redis): a decode that never comes leaves nothing behind for longer; one that comes deletes it
  on read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from kvserve.shared.engine.kv.latency import LatencyStats
from kvserve.shared.engine.kv.load import (
    BatchLoader,
    Chain,
    LoadedBatch,
    LoadJob,
    WriteFrames,
    WriteStacked,
    WriteTemplated,
    block_data,
    loader_pool,
)
from kvserve.shared.store.base import BlockStore
from kvserve.shared.store.block_data import QUANTIZED_KV_DTYPES, BlockData, KVTail
from kvserve.shared.store.codec import BlockMeta, Miss, decode_block, encode_block, frame_bytes
from kvserve.shared.store.hashing import BlockHash, padded_tail, tail_hash, tail_parent

log = logging.getLogger("kvserve.store")

WRITE_BATCH = 32
# Blocks per get of a load: 8 against 16 brings the first batch in sooner and the verification
# and writes start earlier (a 2,048-token load ~20% shorter on `epyc-zen4`).
FETCH_BATCH = 8
# Batches of a load received but not yet written: the next is read once one is done (the store
# reads into buffers the writes hand back: beyond them, each batch's pages are new ones).
LOAD_WINDOW = 4
# Threads that verify and write a load's batches: one. On two cores the store's server and this
# process's reads take most of one core while a load runs; a second loader thread made fresh
# engines' loads no faster (docs/architecture.md).
LOAD_THREADS = 1
TAIL_TTL_S = 30  # an abandoned hand-off's tail key expires after this
# A single stored block is recomputed: a fetch's fixed costs (two round trips, a thread hop,
# the sequence parked for a step) outweigh one block's prefill (bench store --parts breakeven:
# 38-48 ms to load one block against 25-28 ms to recompute it; loading wins from 4 blocks).
MIN_FETCH_BLOCKS = 2
_FORMAT_OF = {dtype: name for name, dtype in QUANTIZED_KV_DTYPES.items()}  # int8 / fp8 caches
LOOKUP_OUTCOMES = ("hit", "absent", "recompute", "timeout", "evicted", "corrupt",
                   "wrong_identity", "unavailable", "breaker_open")  # fmt: skip
# Codec misses of a frame that is damaged (the rest name another block's identity).
_CORRUPT = frozenset({"too_large", "not_msgpack", "bad_schema", "bad_checksum", "bad_payload",
                      "internal_error"})  # fmt: skip


@dataclass
class FetchResult:
    """A lookup's result: after `fetch`, what the store holds and the cost rule's decision;
    after `load`, how many leading blocks were verified and written into the cache."""

    decision: str = "none"  # none (nothing stored) | load | recompute | timeout
    outcome: str = "absent"  # see LOOKUP_OUTCOMES
    present: int = 0  # leading wanted blocks the store said it holds
    loaded: int = 0  # leading blocks of the load written into their cache blocks
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class BlockWrite:
    """A computed block queued for the store."""

    h: BlockHash
    parent: BlockHash
    token_ids: list[int]
    data: BlockData
    first: bool  # block 0 of its chain (parent is the root)


class StoreConnector:
    def __init__(
        self,
        store: BlockStore,
        meta: BlockMeta,
        fmt: str,
        cache_dtype: torch.dtype,
        queue_blocks: int = 1024,
        fetch_timeout_s: float = 2.0,
        *,
        load_threads: int = LOAD_THREADS,
        verify_on_loop: bool = True,
    ) -> None:
        """`load_threads`, `verify_on_loop`: the load's pipeline (the
        defaults are what measured fastest; `kvserve bench store --parts load` compares
        others)."""
        self.store = store
        self.verify_on_loop = verify_on_loop
        self.meta = meta
        self.fmt = fmt
        self.cache_dtype = cache_dtype
        self.fetch_timeout_s = fetch_timeout_s
        self._queue: queue.Queue[BlockWrite] = queue.Queue(maxsize=queue_blocks)
        self.counters: Counter[str] = Counter()
        self.miss_reasons: Counter[str] = Counter()
        self.lookups: Counter[str] = Counter({o: 0 for o in LOOKUP_OUTCOMES})
        self.latency = LatencyStats()  # store get/put call durations and errors
        # Running estimates for the cost rule (seconds), seeded with conservative guesses.
        self.rtt_s = 0.002
        self.fetch_s_per_block = 0.005
        self.encoded_bytes = 0
        self.encoded_tokens = 0
        # Loads verify and write their batches on these threads.
        self._decoders = loader_pool(load_threads, "kvserve-load")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvserve-store")
        self._thread.daemon = True
        self._thread.start()
        self._wake = asyncio.Event()
        self._writer = asyncio.run_coroutine_threadsafe(self._write_loop(), self._loop)
        # The store's connections, and its buffers for a load's batches, opened before the
        # first lookup needs them.
        batch_bytes = FETCH_BATCH * (frame_bytes(meta, fmt) + 16)  # + each value's RESP head
        self.connected = asyncio.run_coroutine_threadsafe(
            self.store.connect(batch_bytes), self._loop
        )

    # ---- engine thread --------------------------------------------------------------------

    def publish(self, writes: Sequence[BlockWrite]) -> list[BlockHash]:
        """Queue computed blocks for the store; the hashes queued (a block is dropped, and
        counted, while the queue is full). The writer is woken once per call."""
        queued: list[BlockHash] = []
        for w in writes:
            try:
                self._queue.put_nowait(w)
            except queue.Full:
                self.counters["dropped_writes"] += 1
                continue
            queued.append(w.h)
        if queued:
            self._loop.call_soon_threadsafe(self._wake.set)
        return queued

    def fetch(
        self, hashes: Sequence[BlockHash], root: BlockHash, recompute_s_per_block: float
    ) -> concurrent.futures.Future[FetchResult]:
        """A lookup's first stage: which leading `hashes` the store holds, and whether to load
        them (the cost rule). A lookup that ends here is counted."""
        return asyncio.run_coroutine_threadsafe(
            self._fetch(list(hashes), root, recompute_s_per_block), self._loop
        )

    def load(
        self,
        res: FetchResult,
        hashes: Sequence[BlockHash],
        root: BlockHash,
        dst: Sequence[int],
        write: WriteStacked,
        job: LoadJob,
        write_frames: WriteFrames | None = None,
        chain: Chain | None = None,
        write_templated: WriteTemplated | None = None,
    ) -> concurrent.futures.Future[FetchResult]:
        """A lookup's second stage: get `hashes`, verify each and write it into cache block
        `dst[i]` (`write_frames` where it takes a batch, else `write`; from worker threads,
        under `job`); `res.loaded` says how many leading blocks were written. Counted.
        `chain`: the blocks' tokens and parents, where the caller knows them (their frames
        are then checked by comparing bytes; with `write_templated`, by the write itself once
        the first frame has made their template)."""
        load = self._load_into(
            res, list(hashes), root, list(dst), write, job, write_frames, chain, write_templated
        )
        return asyncio.run_coroutine_threadsafe(load, self._loop)

    def abandon(self, res: FetchResult) -> None:
        """The engine did not load what `fetch` chose to (no room, or its own cache now holds
        the run): counted as a recompute."""
        self.counters["loads_abandoned"] += 1
        self.lookups["recompute"] += 1

    def contains(self, hashes: Sequence[BlockHash], timeout: float = 10.0) -> list[bool]:
        """Blocking `contains` on the store (for warm-up jobs, not the step path)."""
        fut = asyncio.run_coroutine_threadsafe(self.store.contains(list(hashes)), self._loop)
        return fut.result(timeout)

    def pin(self, hashes: Sequence[BlockHash], timeout: float = 10.0) -> None:
        """Blocking `pin` on the store (for warm-up jobs)."""
        asyncio.run_coroutine_threadsafe(self.store.pin(list(hashes)), self._loop).result(timeout)

    def put_tail(self, request_id: str, tail: KVTail, timeout: float = 10.0) -> bool:
        """Write a prompt's tail block (in the store's format) under its per-request key;
        blocking."""
        bs = self.meta.block_size
        toks = padded_tail(tail.token_ids, bs)
        frame = self._frame(toks, tail.data, tail_parent(request_id), None)
        h = tail_hash(request_id, tail.token_ids, bs)
        coro = self._timed("put", self.store.put_many([(h, frame)], ttl_s=TAIL_TTL_S))
        return bool(asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout))

    async def _timed(self, op: str, coro: Any) -> Any:
        with self.latency.time(op):
            return await coro

    def get_tail(
        self, request_id: str, token_ids: list[int]
    ) -> concurrent.futures.Future[KVTail | None]:
        """Fetch, verify and delete a tail written by `put_tail`; None if absent or bad."""
        return asyncio.run_coroutine_threadsafe(self._get_tail(request_id, token_ids), self._loop)

    async def _get_tail(self, request_id: str, token_ids: list[int]) -> KVTail | None:
        bs = self.meta.block_size
        h = tail_hash(request_id, token_ids, bs)
        try:
            with self.latency.time("get"):
                (frame,) = await asyncio.wait_for(self.store.get_many([h]), self.fetch_timeout_s)
        except TimeoutError:
            return None
        if frame is None:
            self.counters["tail_misses"] += 1
            return None
        await self.store.delete([h])
        got = decode_block(frame, self.meta, h, tail_parent(request_id), dequantize=False)
        if isinstance(got, Miss):
            self.miss_reasons[got.reason] += 1
            return None
        return KVTail(list(token_ids), block_data(got, self.cache_dtype))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block has been written (or skipped). False on timeout."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0 or not self._queue.all_tasks_done.wait(left):
                    return not self._queue.unfinished_tasks
        return True

    def close(self) -> None:
        self.flush()
        self._writer.cancel()
        asyncio.run_coroutine_threadsafe(self.store.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # its selector and self-pipe, not left to the GC
            self._loop.close()
        self._decoders.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = dict(self.counters)
        out["queued_writes"] = self._queue.qsize()
        out["miss_reasons"] = dict(self.miss_reasons)
        out["lookups"] = dict(self.lookups)
        out["bytes_per_token"] = (
            self.encoded_bytes / self.encoded_tokens if self.encoded_tokens else 0.0
        )
        out["store"] = self.store.stats()
        return out

    # ---- store thread ---------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while not self._queue.empty():
                batch: list[BlockWrite] = []
                while len(batch) < WRITE_BATCH:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                try:
                    await self._write(batch)
                finally:
                    for _ in batch:
                        self._queue.task_done()

    async def _write(self, batch: list[BlockWrite]) -> None:
        try:
            items = await asyncio.to_thread(self._encode, batch)
            with self.latency.time("put"):
                written = await self.store.put_many(items)
        except Exception:  # a codec or store bug must not kill the writer
            log.exception("store write failed")
            self.counters["write_errors"] += len(batch)
            return
        self.counters["published_blocks"] += written
        self.counters["skipped_writes"] += len(batch) - written

    def _frame(
        self, token_ids: list[int], data: BlockData, parent: BlockHash, root: BlockHash | None
    ) -> bytes:
        """The block's frame in the store's format: an int8 / fp8 cache's own bytes and scales
        when the format is the cache's, else from its K/V as floats."""
        if (
            data.k_scale is not None
            and data.v_scale is not None
            and self.fmt == _FORMAT_OF.get(self.cache_dtype)
        ):
            scales = (data.k_scale, data.v_scale)
            return encode_block(
                self.meta, token_ids, data.k, data.v, self.fmt, parent, scales=scales
            )
        k, v = data.to_float()
        return encode_block(self.meta, token_ids, k, v, self.fmt, parent, root=root)

    def _encode(self, batch: list[BlockWrite]) -> list[tuple[BlockHash, bytes]]:
        out = []
        for p in batch:
            frame = self._frame(p.token_ids, p.data, p.parent, p.parent if p.first else None)
            self.encoded_bytes += len(frame)
            self.encoded_tokens += len(p.token_ids)
            out.append((p.h, frame))
        return out

    async def _fetch(
        self, hashes: list[BlockHash], root: BlockHash, recompute_s_per_block: float
    ) -> FetchResult:
        try:
            res = await asyncio.wait_for(
                self._fetch_run(hashes, root, recompute_s_per_block), self.fetch_timeout_s
            )
        except TimeoutError:
            self.counters["fetch_timeouts"] += 1
            self.latency.error("get")
            res = FetchResult(decision="timeout", outcome="timeout")
        except Exception:
            self.lookups["unavailable"] += 1
            raise
        if res.decision != "load":  # a load is counted when it ends
            self.lookups[res.outcome] += 1
        return res

    async def _fetch_run(
        self, hashes: list[BlockHash], root: BlockHash, recompute_s_per_block: float
    ) -> FetchResult:
        t0 = time.perf_counter()
        presence = await self.store.presence(hashes)
        t1 = time.perf_counter()
        run = next((i for i, p in enumerate(presence.stored) if not p), len(hashes))
        res = FetchResult(present=run, timings={"contains_s": t1 - t0})
        if hashes and run == 0 and presence.short_circuited[0]:
            res.outcome = "breaker_open"  # nothing was sent: the round-trip estimate stays
            return res
        self.rtt_s = 0.8 * self.rtt_s + 0.2 * (t1 - t0)
        if run == 0:
            return res
        est_fetch = self.rtt_s + run * self.fetch_s_per_block
        est_recompute = run * recompute_s_per_block
        worth = run >= MIN_FETCH_BLOCKS and est_fetch < est_recompute
        res.decision = "load" if worth else "recompute"
        res.outcome = res.decision if res.decision == "recompute" else "hit"
        self.counters[f"decision_{res.decision}"] += 1
        log.info(
            "store fetch decision=%s blocks=%d est_fetch_s=%.4f est_recompute_s=%.4f",
            res.decision,
            run,
            est_fetch,
            est_recompute,
        )
        return res

    async def _load_into(
        self,
        res: FetchResult,
        hashes: list[BlockHash],
        root: BlockHash,
        dst: list[int],
        write: WriteStacked,
        job: LoadJob,
        write_frames: WriteFrames | None = None,
        chain: Chain | None = None,
        write_templated: WriteTemplated | None = None,
    ) -> FetchResult:
        t0 = time.perf_counter()
        try:
            load = self._load(
                hashes, root, dst, write, job, res, write_frames, chain, write_templated
            )
            await asyncio.wait_for(load, self.fetch_timeout_s)
        except TimeoutError:
            self.counters["fetch_timeouts"] += 1
            self.latency.error("get")
            res.decision, res.outcome, res.loaded = "timeout", "timeout", 0
        except Exception:
            res.outcome, res.loaded = "unavailable", 0
            raise
        finally:
            job.stop()
            self.lookups[res.outcome] += 1
        t1 = time.perf_counter()
        res.timings["load_s"] = t1 - t0
        if res.loaded:
            self.fetch_s_per_block = 0.8 * self.fetch_s_per_block + 0.2 * (t1 - t0) / res.loaded
        self.counters["fetched_blocks"] += res.loaded
        return res

    def _write_batch(
        self,
        frames: Sequence[bytes | memoryview | None],
        fn: Callable[..., LoadedBatch],
        *args: Any,
    ) -> asyncio.Future[LoadedBatch]:
        """`fn(*args)` on a loader thread; `frames`' buffer goes back to the store once that
        thread is done with it (not when a cancelled wait gives up on it)."""

        def recycle(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the connector closed meanwhile
                self._loop.call_soon_threadsafe(self.store.recycle, frames)

        done = self._decoders.submit(fn, *args)
        done.add_done_callback(recycle)
        return asyncio.wrap_future(done)

    async def _load(
        self,
        hashes: list[BlockHash],
        root: BlockHash,
        dst: list[int],
        write: WriteStacked,
        job: LoadJob,
        res: FetchResult,
        write_frames: WriteFrames | None = None,
        chain: Chain | None = None,
        write_templated: WriteTemplated | None = None,
    ) -> None:
        """Get the blocks in batches of FETCH_BATCH, every batch's read sent at once
        (`stream_views`: on Redis one connection, the replies one after the other), each batch
        verified as soon as it arrives and written into its cache blocks on the loader thread
        (transfer, verification and copies overlap). `res.loaded`: the leading run written, up
        to the first missing or bad frame (deleted from the store); no batch after it is read.

        With `verify_on_loop` a batch is verified on this event loop's thread, right after its
        reply (~1 ms of Python a batch, during which the kernel receives the next one), and the
        loader thread only writes (C++, without the GIL where it applies): the loop and the
        loader then do not hand the GIL back and forth, which made a 2,048-token load 20-27%
        slower (`bench store --parts load`)."""

        loader = BatchLoader(
            self.meta, self.cache_dtype, root, write, job, self.fmt, write_frames, chain,
            write_templated,
        )  # fmt: skip
        writes: list[asyncio.Future[LoadedBatch]] = []
        stream = self.store.stream_views(hashes, FETCH_BATCH)
        try:
            at = 0
            while at < len(hashes):
                pending = [w for w in writes if not w.done()]
                if len(pending) >= LOAD_WINDOW:
                    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                with self.latency.time("get"):
                    frames = await anext(stream)
                part, out = hashes[at : at + FETCH_BATCH], dst[at : at + FETCH_BATCH]
                if self.verify_on_loop:
                    verified = loader.verify(part, frames, at)
                    writes.append(self._write_batch(frames, loader.write, verified, out))
                    if verified.got.miss is not None:
                        break
                else:
                    writes.append(self._write_batch(frames, loader.load, part, frames, out, at))
                at += FETCH_BATCH
        finally:
            await stream.aclose()
        done = await asyncio.gather(*writes)
        res.timings["decode_cpu_s"] = sum(d.seconds for d in done)
        res.timings["verify_cpu_s"] = sum(d.verify_s for d in done)
        res.timings["write_cpu_s"] = sum(d.write_s for d in done)
        res.outcome, res.loaded = "hit", 0
        for d in done:
            res.loaded += d.written
            if d.miss is None:
                continue
            self.miss_reasons[d.miss] += 1
            if d.bad is None:
                res.outcome = "evicted"
            else:
                res.outcome = "corrupt" if d.miss in _CORRUPT else "wrong_identity"
                log.warning("store block %s rejected: %s", d.bad.hex()[:16], d.miss)
                await self.store.delete([d.bad])
            return
