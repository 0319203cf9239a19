"""Engine: requests in, token and text deltas out, one `step()` at a time.

A step is: schedule -> run the model -> sample -> append tokens, fork n > 1 siblings, detect
stops -> emit deltas. Not thread-safe: one thread drives it (see AsyncEngine for the async API).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import itertools
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from kvserve.kernels import cpp_build
from kvserve.kernels.backend import get_backend
from kvserve.shared.config import DEFAULT_STORE, EngineConfig, ModelConfig, cache_dir
from kvserve.shared.engine.beam_search import BeamSearch
from kvserve.shared.engine.block_pool import BlockPool
from kvserve.shared.engine.kv_cache import KVCache, kv_bytes_per_token, resolve_kv_dtype
from kvserve.shared.engine.model_runner import ModelRunner
from kvserve.shared.engine.sampler import Sampler, SampleRow
from kvserve.shared.engine.scheduler import Batch, ScheduledSeq, Scheduler
from kvserve.shared.engine.sequence import (
    BlockId,
    FinishReason,
    SeqId,
    Sequence,
    SequenceStatus,
)
from kvserve.shared.model.llama import LlamaModel
from kvserve.shared.model.loader import LoadedWeights, load_weights
from kvserve.shared.model.tokenizer import IncrementalDetokenizer, KVTokenizer
from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams
from kvserve.shared.store.base import open_store
from kvserve.shared.store.block_data import BlockData
from kvserve.shared.store.codec import BlockMeta
from kvserve.shared.store.hashing import (
    BlockHash,
    InvalidSaltError,
    block_hashes,
    root_hash,
    validate_cache_salt,
)
from kvserve.shared.store.tiers import FetchResult, HostTier, KVTail, StoreConnector

log = logging.getLogger("kvserve.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CompletionDelta:
    """What one completion (one of n, or the best beam) produced since the last output."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None = None
    # with SamplingParams.top_logprobs: per token, {token id: logprob} of the most likely ones
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    completions: list[CompletionDelta]
    finished: bool
    kv_tail: KVTail | None = None  # with export_tail, on the finished output


@dataclass
class _Completion:
    """Per-completion output state: detokenizer and how much was already emitted."""

    seq: Sequence
    detok: IncrementalDetokenizer
    sent_tokens: int = 0
    sent_text: int = 0
    text: str = ""  # full text so far (truncated at a stop string once found)


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    root_hash: BlockHash | None = None
    completions: dict[int, _Completion] = field(default_factory=dict)
    beam: BeamSearch | None = None
    beam_seqs: list[Sequence] = field(default_factory=list)  # live beams, in beam order
    beam_rows: dict[SeqId, torch.Tensor] = field(default_factory=dict)  # this step's rows
    export_tail: bool = False
    kv_tail: KVTail | None = None

    @property
    def finished(self) -> bool:
        return len(self.completions) == self.params.n and all(
            c.seq.is_finished for c in self.completions.values()
        )


@dataclass
class _Fetch:
    """A request parked while its prefix blocks come from the store."""

    future: concurrent.futures.Future[FetchResult]
    seq: Sequence
    deadline: float
    started: float = field(default_factory=time.perf_counter)


def store_url(url: str) -> str:
    """``"default"``: the disk tier under the cache directory; anything else as given."""
    return f"file://{cache_dir() / 'store'}" if url == DEFAULT_STORE else url


_T = TypeVar("_T")


@contextlib.contextmanager
def _timed(into: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into[name] = time.perf_counter() - t0


def _weak_callback(method: Callable[[_T], None]) -> Callable[[_T], None]:
    """`method` of an engine, called through a weak reference: the scheduler or pool holding it
    then keeps no reference cycle through the engine, so dropping an engine frees its KV cache
    (GBs) at once rather than at the garbage collector's next full pass."""
    ref = weakref.WeakMethod(method)

    def call(arg: _T) -> None:
        bound = ref()
        assert bound is not None, "the engine is gone"
        bound(arg)

    return call


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        tokenizer: KVTokenizer | None = None,
        weights: LoadedWeights | None = None,
    ) -> None:
        """`weights` and `tokenizer` may be passed in to share one load between engines."""
        self.config = config
        # Seconds each part of start-up took (kvserve bench startup reports them).
        self.startup_s: dict[str, float] = {}
        phase = functools.partial(_timed, self.startup_s)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype = DTYPES[config.dtype]
        with phase("model_read"):
            loaded = weights or load_weights(config.model_path, dtype)
        self.model_config: ModelConfig = loaded.config
        matmul = config.resolved_matmul_dtype
        # Other matmul numerics give other K/V: such blocks must not meet in a shared store.
        self.model_fingerprint = (
            loaded.fingerprint
            if matmul == config.dtype
            else hashlib.sha256(f"{loaded.fingerprint}/matmul={matmul}".encode()).hexdigest()
        )
        with phase("tokenizer"):
            self.tokenizer = tokenizer or KVTokenizer.from_path(config.model_path)
        with phase("kernel_load"):
            if torch.device(config.device).type == "cpu":
                cpp_build.extension()
        with phase("weight_packing"):
            # Weights go to the device first: the model prepacks them for that device.
            on_device = {k: v.to(config.device) for k, v in loaded.weights.items()}
            model = LlamaModel(loaded.config, on_device, DTYPES[matmul]).eval()
        cc = config.cache
        self.kv_dtype = resolve_kv_dtype(cc.kv_dtype, dtype)
        self.block_size = cc.block_size
        num_blocks = cc.num_blocks or max(
            1,
            cc.memory_budget_bytes
            // (kv_bytes_per_token(loaded.config, self.kv_dtype) * cc.block_size),
        )
        self.max_model_len = loaded.config.max_position_embeddings
        with phase("kv_cache"):
            cache = KVCache(
                loaded.config, num_blocks, cc.block_size, self.kv_dtype, config.device, cc.populate
            )
        backend = get_backend(config.attention_backend, config.device)
        self.runner = ModelRunner(model, cache, backend)
        self.pool = BlockPool(num_blocks, enable_caching=cc.enable_prefix_caching)
        self.scheduler = Scheduler(
            config.scheduler,
            self.pool,
            cc.block_size,
            _weak_callback(self._match_prefix) if cc.enable_prefix_caching else None,
        )
        self.tokenizer_fingerprint = self.tokenizer.fingerprint
        self.kv_format = str(self.kv_dtype).removeprefix("torch.")
        self.host_tier: HostTier | None = None
        self.connector: StoreConnector | None = None
        self._fetching: dict[str, _Fetch] = {}
        # Running estimate of prefill seconds per token, for the store's cost rule.
        self.prefill_s_per_token = 1 / 300
        self.last_fetch: FetchResult | None = None  # the latest finished fetch (benchmarks)
        self.copy_in_s = 0.0  # total time spent copying host-tier blocks into the cache
        if config.store.url and cc.enable_prefix_caching:
            with phase("store"):
                self._open_tiers()
        self.sampler = Sampler()
        self.eos_token_ids = set(self.model_config.eos_token_ids) | set(
            self.tokenizer.eos_token_ids
        )
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_steps = 0
        # n > 1 siblings created while their parent's row is sampled, forked right after.
        self._pending_children: dict[tuple[SeqId, int], Sequence] = {}

    def _open_tiers(self) -> None:
        sc = self.config.store
        assert sc.url is not None
        self.host_tier = HostTier(sc.host_tier_bytes)
        self.pool.on_evict = _weak_callback(self._offload)
        self.connector = StoreConnector(
            open_store(store_url(sc.url)),
            self.block_meta,
            sc.format,
            self.kv_dtype,
            sc.write_queue_blocks,
            sc.fetch_timeout_s,
        )

    @property
    def block_meta(self) -> BlockMeta:
        """What this engine stamps on, and expects of, every stored block frame."""
        mc = self.model_config
        return BlockMeta(
            self.model_fingerprint,
            self.kv_format,
            self.block_size,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
        )

    def close(self) -> None:
        """Write out queued blocks and close the store. The engine is unusable afterwards."""
        self.runner.cache.close()
        if self.connector is not None:
            self.connector.close()
            self.connector = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def warmup(
        self, prefix: Seq[int], cache_salt: str | None = None, request_id: str = "warmup"
    ) -> dict[str, int]:
        """A shared-prefix warm-up job for one prefix: compute its full blocks unless the
        store already holds them all, publish what the store lacks, and pin them in the store
        and the host tier. Runs on the engine's thread (it steps the engine). Returns
        {"blocks", "computed" (0 or 1), "published", "skipped" (0 or 1)}."""
        if self.connector is None or self.host_tier is None or self.pool.index is None:
            raise RuntimeError("warm-up needs a prefix store (EngineConfig.store.url)")
        bs = self.block_size
        n = len(prefix) // bs
        if n == 0:
            raise InvalidRequestError("prefix", f"a prefix needs at least {bs} tokens")
        root = self.root_hash(cache_salt)
        hashes = block_hashes(root, list(prefix[: n * bs]), bs)
        stored = self.connector.contains(hashes)
        out = {"blocks": n, "computed": 0, "published": 0, "skipped": int(all(stored))}
        if not all(stored):
            self.add_request(request_id, prefix, SamplingParams(max_tokens=1), cache_salt)
            while request_id in self._requests:
                self.step()
            out["computed"] = 1
        self.connector.flush()
        stored = self.connector.contains(hashes)
        on_device = [(i, self.pool.index.block_of(h)) for i, h in enumerate(hashes)]
        found = [(i, b) for i, b in on_device if b is not None]
        read = self.runner.cache.read_blocks([b for _, b in found])
        data = {i: d for (i, _), d in zip(found, read, strict=True)}
        for i, h in enumerate(hashes):
            if i not in data:
                continue
            self.host_tier.pin(h, data[i], "host")
            if not stored[i]:
                toks = list(prefix[i * bs : (i + 1) * bs])
                parent = hashes[i - 1] if i else root
                self.connector.publish(h, parent, toks, data[i], first=i == 0)
                out["published"] += 1
        self.connector.flush()
        self.connector.pin(hashes)
        return out

    def reset_prefix_cache(self) -> dict[str, int]:
        """Drop the device prefix cache's unreferenced blocks and the whole host tier (like
        vLLM's reset_prefix_cache); blocks running requests hold, and the store, stay. Runs on
        the engine's thread. Returns {"device_blocks", "host_blocks"} dropped."""
        host = self.host_tier.clear() if self.host_tier is not None else 0
        return {"device_blocks": self.pool.drop_cached(), "host_blocks": host}

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (naming the field) for a request that can never run."""
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError("prompt", f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the context window of {self.max_model_len} tokens",
            )
        if -(-total // self.block_size) > self.pool.num_blocks:
            raise InvalidRequestError(
                "max_tokens", f"a sequence of {total} tokens cannot fit in the KV cache"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        *,
        kv_tail: KVTail | None = None,
        export_tail: bool = False,
    ) -> None:
        """Queue a request. Requests with different `cache_salt`s never share a block.

        Disaggregation: `export_tail` (prefill side) puts the prompt's partial last block on
        the finished output (`RequestOutput.kv_tail`); `kv_tail` (decode side) is that block,
        used instead of recomputing it when every full block before it is cached or stored."""
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"duplicate request id {request_id!r}")
        self.validate(prompt_token_ids, params)
        try:
            validate_cache_salt(cache_salt)
        except InvalidSaltError as e:
            raise InvalidRequestError("cache_salt", str(e)) from e
        prompt = list(prompt_token_ids)
        req = _Request(request_id, prompt, params, root_hash=self.root_hash(cache_salt))
        req.export_tail = export_tail
        seq = self._new_seq(req, 0, prompt)
        seq.kv_tail = kv_tail
        seq.pending_forks = params.n - 1
        if params.beam_width > 1:
            eos = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            req.beam = BeamSearch(
                params.beam_width,
                params.max_tokens,
                eos,
                params.length_penalty,
                params.early_stopping,
            )
            req.beam_seqs = [seq]
        self._requests[request_id] = req
        fetch = self._start_fetch(seq)
        if fetch is None:
            self.scheduler.add(seq)
        else:
            self._fetching[request_id] = fetch

    def _new_seq(self, req: _Request, index: int, token_ids: list[int]) -> Sequence:
        params = req.params
        gen = None
        if not params.greedy:
            gen = torch.Generator()
            gen.manual_seed(params.seed + index if params.seed is not None else torch.seed())
        seq = Sequence(
            seq_id=SeqId(next(self._seq_ids)),
            request_id=req.request_id,
            index=index,
            token_ids=list(token_ids),
            num_prompt_tokens=len(req.prompt),
            params=params,
            arrival=next(self._arrivals),
            generator=gen,
            root_hash=req.root_hash,
        )
        req.completions[index] = _Completion(
            seq, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        )
        return seq

    def root_hash(self, cache_salt: str | None = None) -> BlockHash:
        return root_hash(
            self.model_fingerprint,
            self.tokenizer_fingerprint,
            self.kv_format,
            self.block_size,
            cache_salt,
        )

    # ---- prefix caching -------------------------------------------------------------------

    def _match_prefix(self, seq: Sequence) -> None:
        """Attach the longest cached run of full blocks: first the device cache's, then its
        continuation from the host tier (copied into fresh device blocks and cached there).
        The last token is always computed (its logits are needed), so at most
        (num_tokens - 1) // block_size blocks match."""
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = seq.full_block_hashes(limit, self.block_size)
        blocks = self.pool.match_prefix(hashes)
        sources = {"device": len(blocks) * self.block_size}
        if self.host_tier is not None and len(blocks) < limit:
            run: list[tuple[BlockHash, BlockData, str]] = []
            for h in hashes[len(blocks) : len(blocks) + self.pool.num_free]:
                got = self.host_tier.get(h)
                if got is None:
                    break
                run.append((h, *got))
            new = self.pool.allocate(len(run)) if run else None
            if new:
                t0 = time.perf_counter()
                self.runner.cache.write_blocks(new, [d for _, d, _ in run])
                self.copy_in_s += time.perf_counter() - t0
                for (h, _, src), b in zip(run, new, strict=True):
                    self.pool.cache(blocks[-1] if blocks else None, h, b)
                    blocks.append(b)
                    sources[src] = sources.get(src, 0) + self.block_size
        seq.block_table = blocks
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_published = len(blocks)
        seq.cached_tokens_by_source = sources
        tail, seq.kv_tail = seq.kv_tail, None  # used once: after a preemption, recompute
        if tail is not None and len(blocks) == limit:
            start = seq.num_computed_tokens
            end = start + len(tail.token_ids)
            if end < seq.num_tokens and seq.token_ids[start:end] == tail.token_ids:
                new = self.pool.allocate(1)
                if new:
                    self.runner.cache.write_blocks(new, [tail.data])
                    blocks.append(new[0])
                    seq.num_computed_tokens = end
                    sources["store"] = sources.get("store", 0) + len(tail.token_ids)

    def _publish_full_blocks(self, seq: Sequence) -> None:
        """Put the sequence's newly computed full blocks in the prefix index, and queue those
        newly cached for the store (write-behind)."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_published or seq.root_hash is None:
            return
        hashes = seq.full_block_hashes(full, self.block_size)
        fresh: list[int] = []
        for i in range(seq.num_published, full):
            parent = seq.block_table[i - 1] if i else None
            if self.pool.cache(parent, hashes[i], seq.block_table[i]):
                fresh.append(i)
        seq.num_published = full
        if self.connector is not None and fresh:
            data = self.runner.cache.read_blocks([seq.block_table[i] for i in fresh])
            bs = self.block_size
            for i, d in zip(fresh, data, strict=True):
                parent_hash = hashes[i - 1] if i else seq.root_hash
                toks = seq.token_ids[i * bs : (i + 1) * bs]
                self.connector.publish(hashes[i], parent_hash, toks, d, first=i == 0)

    def _offload(self, evicted: list[tuple[BlockId, BlockHash]]) -> None:
        """BlockPool eviction hook: keep evicted blocks in the host tier."""
        assert self.host_tier is not None
        todo = [(b, h) for b, h in evicted if h not in self.host_tier]
        if todo:
            data = self.runner.cache.read_blocks([b for b, _ in todo])
            for (_, h), d in zip(todo, data, strict=True):
                self.host_tier.put(h, d, "host")

    def _start_fetch(self, seq: Sequence) -> _Fetch | None:
        """Ask the store for the full prompt blocks that neither the device cache nor the host
        tier holds (they must continue the locally held run). None when there is nothing to
        ask for; the request then goes straight to the scheduler."""
        if self.connector is None or self.pool.index is None or seq.root_hash is None:
            return None
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = seq.full_block_hashes(limit, self.block_size)
        start = len(self.pool.index.match(hashes))
        assert self.host_tier is not None
        while start < limit and hashes[start] in self.host_tier:
            start += 1
        if start >= limit:
            return None
        recompute_s = self.prefill_s_per_token * self.block_size
        fut = self.connector.fetch(hashes[start:], seq.root_hash, recompute_s)
        deadline = time.monotonic() + self.config.store.fetch_timeout_s + 1.0
        return _Fetch(fut, seq, deadline)

    def _admit_fetched(self, wait: bool) -> None:
        """Hand requests whose fetch has finished (or overrun) to the scheduler, their blocks
        staged in the host tier. With `wait` (nothing else to do) wait briefly for one."""
        if not self._fetching:
            return
        if wait:
            concurrent.futures.wait(
                [f.future for f in self._fetching.values()],
                timeout=0.05,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        now = time.monotonic()
        for rid, f in list(self._fetching.items()):
            if not f.future.done() and now < f.deadline:
                continue
            del self._fetching[rid]
            res = FetchResult(decision="timeout")
            if f.future.done() and not f.future.cancelled() and f.future.exception() is None:
                res = f.future.result()
            else:
                f.future.cancel()
            assert self.host_tier is not None
            res.timings["admitted_after_s"] = time.perf_counter() - f.started
            self.last_fetch = res
            for h, data in res.blocks:
                self.host_tier.put(h, data, "store")
            if res.decision != "none":
                log.info(
                    "request %s: store %s, %d of %d blocks loaded",
                    rid,
                    res.decision,
                    len(res.blocks),
                    res.present,
                )
            self.scheduler.add(f.seq)

    @property
    def prefix_cache_stats(self) -> dict[str, int]:
        by_source = self.scheduler.cached_tokens_by_source
        return {
            "queries_tokens": self.scheduler.prefix_query_tokens,
            "hits_tokens": self.scheduler.prefix_hit_tokens,
            "cached_blocks": len(self.pool.index) if self.pool.index else 0,
            "evicted_blocks": self.pool.num_evicted,
            **{f"hits_tokens_{src}": n for src, n in by_source.items()},
            "host_tier_blocks": len(self.host_tier) if self.host_tier is not None else 0,
        }

    def store_stats(self) -> dict[str, object]:
        """The connector's counters (decisions, published, dropped, miss reasons) and the
        store backend's; empty without a store."""
        return self.connector.stats() if self.connector is not None else {}

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once. False if it is unknown or finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        fetch = self._fetching.pop(request_id, None)
        if fetch is not None:
            fetch.future.cancel()
        for seq in [c.seq for c in req.completions.values()] + req.beam_seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._admit_fetched(wait=not self.scheduler.has_work())
        batch = self.scheduler.schedule()
        if not batch:
            return []
        t0 = time.perf_counter()
        out = self.runner.run(batch)
        self._observe_prefill(batch, time.perf_counter() - t0)
        for s in batch.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            if self.pool.index is not None:
                self._publish_full_blocks(s.seq)
        self.num_steps += 1
        if not out.sampling_seqs:  # only prompt chunks this step
            return []
        beam = [i for i, q in enumerate(out.sampling_seqs) if self._requests[q.request_id].beam]
        if beam:
            touched = self._beam_step(out.sampling_seqs, out.logits, beam)
            keep = [i for i in range(len(out.sampling_seqs)) if i not in set(beam)]
            seqs = [out.sampling_seqs[i] for i in keep]
            touched += self._sample(seqs, out.logits[keep])
        else:
            touched = self._sample(out.sampling_seqs, out.logits)
        return [self._output(self._requests[r]) for r in touched if r in self._requests]

    def _observe_prefill(self, batch: Batch, seconds: float) -> None:
        """Update the prefill-speed estimate from steps that are mostly prompt tokens."""
        prompt = sum(s.num_new_tokens for s in batch.scheduled if s.num_new_tokens > 1)
        if prompt >= 64 and prompt >= batch.num_tokens // 2:
            self.prefill_s_per_token = 0.7 * self.prefill_s_per_token + 0.3 * (
                seconds / batch.num_tokens
            )

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[str]:
        """Sample one token per sequence; a sequence with pending forks samples once per
        sibling from the same row and forks the siblings, sharing its blocks."""
        row_idx: list[int] = []
        targets: list[tuple[Sequence, int]] = []  # (sequence, sibling index or -1 for itself)
        for i, seq in enumerate(seqs):
            row_idx.append(i)
            targets.append((seq, -1))
            for j in range(seq.pending_forks):
                row_idx.append(i)
                targets.append((seq, j + 1))
        rows = [self._sample_row(seq, j) for seq, j in targets]
        if len(row_idx) != len(seqs):
            logits = logits[torch.tensor(row_idx)]
        tokens, logprobs, tops = self.sampler.sample(logits, rows)
        touched: dict[str, None] = {}
        # Fork every sibling before any token is appended: a parent that stops on its first
        # token frees its blocks, which the siblings must already share.
        owners = [seq if j < 0 else self._fork(seq, j) for seq, j in targets]
        for owner, tok, lp, top in zip(owners, tokens, logprobs, tops, strict=True):
            self._append(owner, tok, lp, top)
            touched[owner.request_id] = None
        for seq in seqs:
            seq.pending_forks = 0
        return list(touched)

    def _beam_step(self, seqs: list[Sequence], logits: torch.Tensor, rows: list[int]) -> list[str]:
        """Stash each beam's log-softmax row; advance every beam request whose live beams all
        have theirs (a preempted beam makes its siblings wait, computed, for it)."""
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        ready: dict[str, _Request] = {}
        for i, row in zip(rows, logprobs, strict=True):
            req = self._requests[seqs[i].request_id]
            req.beam_rows[seqs[i].seq_id] = row
            if len(req.beam_rows) == len(req.beam_seqs):
                ready[req.request_id] = req
        done = []
        for req in ready.values():
            if self._advance_beams(req):
                done.append(req.request_id)
        return done

    def _advance_beams(self, req: _Request) -> bool:
        """One beam-search step: fork the chosen parents (blocks shared, copy-on-write on
        the next write), drop unchosen beams. Returns True when the search has finished."""
        assert req.beam is not None
        rows = torch.stack([req.beam_rows.pop(s.seq_id) for s in req.beam_seqs])
        cands = req.beam.step(rows)
        if req.beam.done:
            for seq in req.beam_seqs:
                self.scheduler.finish(seq, FinishReason.ABORT)
            req.beam_seqs = []
            self._finish_beam_request(req)
            return True
        parents = req.beam_seqs
        chosen: list[Sequence] = []
        taken: set[int] = set()
        for c in cands:  # fork before any parent appends its token
            if c.parent in taken:
                chosen.append(self._fork_beam(req, parents[c.parent]))
            else:
                taken.add(c.parent)
                chosen.append(parents[c.parent])
        for i, seq in enumerate(parents):
            if i not in taken:
                self.scheduler.finish(seq, FinishReason.ABORT)
        for seq, c in zip(chosen, cands, strict=True):
            seq.token_ids.append(c.token)
            seq.cumulative_logprob = c.score
        req.beam_seqs = chosen
        return False

    def _fork_beam(self, req: _Request, parent: Sequence) -> Sequence:
        child = Sequence(
            seq_id=SeqId(next(self._seq_ids)),
            request_id=req.request_id,
            index=0,
            token_ids=list(parent.token_ids),
            num_prompt_tokens=parent.num_prompt_tokens,
            params=parent.params,
            arrival=next(self._arrivals),
            num_computed_tokens=parent.num_computed_tokens,
            block_table=list(parent.block_table),
            num_cached_tokens=parent.num_cached_tokens,
            root_hash=parent.root_hash,
            block_hashes=list(parent.block_hashes),
            num_published=parent.num_published,
        )
        self.pool.share(child.block_table)
        self.scheduler.add_running(child)
        return child

    def _finish_beam_request(self, req: _Request) -> None:
        """The best hypothesis becomes completion 0."""
        assert req.beam is not None
        best = req.beam.best()
        comp = req.completions[0]
        result = Sequence(
            seq_id=comp.seq.seq_id,
            request_id=req.request_id,
            index=0,
            token_ids=req.prompt + list(best.token_ids),
            num_prompt_tokens=len(req.prompt),
            params=req.params,
            arrival=comp.seq.arrival,
            num_cached_tokens=comp.seq.num_cached_tokens,
        )
        result.status = SequenceStatus.FINISHED
        ends_in_eos = bool(best.token_ids) and best.token_ids[-1] in req.beam.eos
        result.finish_reason = FinishReason.STOP if ends_in_eos else FinishReason.LENGTH
        comp.seq = result
        for tok in best.token_ids:
            comp.text += comp.detok.add(tok)

    def _sample_row(self, seq: Sequence, sibling: int) -> SampleRow:
        if sibling < 0:
            return SampleRow(seq.params, seq.generator)
        # The sibling's generator is created now, seeded like its index (seed + index).
        req = self._requests[seq.request_id]
        child = self._new_seq(req, sibling, seq.token_ids)
        self._pending_children[(seq.seq_id, sibling)] = child
        return SampleRow(child.params, child.generator)

    def _fork(self, parent: Sequence, sibling: int) -> Sequence:
        child = self._pending_children.pop((parent.seq_id, sibling))
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_published = parent.num_published
        self.pool.share(child.block_table)
        self.scheduler.add_running(child)
        return child

    def _append(
        self, seq: Sequence, token: int, logprob: float, top: dict[int, float] | None = None
    ) -> None:
        seq.token_ids.append(token)
        if seq.params.logprobs:
            seq.logprobs.append(logprob)
            if seq.params.top_logprobs:
                seq.top_logprobs.append(top or {})
        seq.cumulative_logprob += logprob
        comp = self._requests[seq.request_id].completions[seq.index]
        comp.text += comp.detok.add(token)
        reason = self._stop_reason(seq, comp, token)
        if reason is not None:
            req = self._requests[seq.request_id]
            if req.export_tail and seq.index == 0:
                req.kv_tail = self._tail_of(seq)
            self.scheduler.finish(seq, reason)

    def _tail_of(self, seq: Sequence) -> KVTail | None:
        """The prompt's partial last block (None when the prompt is whole blocks)."""
        bs = self.block_size
        full = seq.num_prompt_tokens // bs
        if seq.num_prompt_tokens == full * bs or len(seq.block_table) <= full:
            return None
        (data,) = self.runner.cache.read_blocks([seq.block_table[full]])
        return KVTail(seq.token_ids[full * bs : seq.num_prompt_tokens], data)

    def _stop_reason(self, seq: Sequence, comp: _Completion, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if p.stop:
            # Only the new text (plus a stop string's length before it) can hold a new match.
            window = max(len(s) for s in p.stop) + 32
            start = max(0, len(comp.text) - window)
            hits = [i for s in p.stop if (i := comp.text.find(s, start)) >= 0]
            if hits:
                comp.text = comp.text[: min(hits)]
                return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _output(self, req: _Request) -> RequestOutput:
        finished = req.finished
        hold = max((len(s) for s in req.params.stop), default=1) - 1
        deltas = []
        for idx in sorted(req.completions):
            c = req.completions[idx]
            seq = c.seq
            toks = seq.output_token_ids
            # Hold back text that could still become a stop string, unless this one is done.
            visible = len(c.text) if seq.is_finished else max(c.sent_text, len(c.text) - hold)
            delta = CompletionDelta(
                index=idx,
                token_ids=toks[c.sent_tokens :],
                text=c.text[c.sent_text : visible],
                logprobs=seq.logprobs[c.sent_tokens :] if seq.params.logprobs else [],
                top_logprobs=seq.top_logprobs[c.sent_tokens :] if seq.params.logprobs else [],
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            )
            c.sent_tokens, c.sent_text = len(toks), visible
            deltas.append(delta)
        first = req.completions[0].seq
        if finished:
            del self._requests[req.request_id]
        return RequestOutput(
            req.request_id,
            req.prompt,
            first.num_cached_tokens,
            deltas,
            finished,
            kv_tail=req.kv_tail if finished else None,
        )

    @torch.inference_mode()
    def score(self, token_ids: Seq[int]) -> torch.Tensor:
        """Logits [T, vocab] (float32) at every position of `token_ids`, computed in one pass
        outside the scheduler (for perplexity and fidelity checks); changes no request."""
        self.validate(token_ids, SamplingParams(max_tokens=1))
        seq = Sequence(
            SeqId(-1), "score", 0, list(token_ids), len(token_ids), SamplingParams(), arrival=-1
        )
        blocks = self.pool.allocate(seq.blocks_needed(len(token_ids), self.block_size))
        if blocks is None:
            raise RuntimeError("not enough free KV blocks to score this sequence")
        seq.block_table = blocks
        try:
            batch = Batch(scheduled=[ScheduledSeq(seq, len(token_ids))])
            _, hidden = self.runner.forward(batch)
            return self.runner.model.compute_logits(hidden)
        finally:
            self.pool.free(blocks)

    # ---- convenience ----------------------------------------------------------------------

    def generate(
        self,
        prompts: Iterable[Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
    ) -> list[list[list[int]]]:
        """Run prompts to completion; returns, per prompt, the token ids of each completion."""
        prompts = list(prompts)
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{os.getpid()}-{next(self._seq_ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        results: dict[str, dict[int, list[int]]] = {rid: {} for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                for d in out.completions:
                    results[out.request_id].setdefault(d.index, []).extend(d.token_ids)
        return [[results[rid][i] for i in sorted(results[rid])] for rid in ids]
