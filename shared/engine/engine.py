"""Engine: requests in, token and text deltas out, one `step()` at a time.

A step: admit the requests whose store fetch has landed -> schedule -> run the model -> publish
the newly full blocks -> sample (or advance beam searches) -> append tokens, fork n > 1
siblings, detect stops -> emit deltas.

Owns the request table and the step loop. Blocks, in every tier, belong to the KVCacheManager
(`kv`); the waiting and running queues to the Scheduler; a beam search's live beams to its
BeamGroup. Not thread-safe: one thread drives it (see AsyncEngine for the async API).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import random
import time
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from kvserve.kernels import cpp_build, cpu_qlinear
from kvserve.kernels.backend import get_backend
from kvserve.shared.config import EngineConfig, ModelConfig
from kvserve.shared.engine.beam_search import BeamGroup, BeamSearch
from kvserve.shared.engine.kv_cache import KVCache, kv_bytes_per_token, resolve_kv_dtype
from kvserve.shared.engine.kv_cache_manager import KVCacheManager, KVIdentity
from kvserve.shared.engine.model_runner import ModelRunner
from kvserve.shared.engine.outputs import Completion, Emitted, RequestOutput
from kvserve.shared.engine.sampler import Sampler, SampleRow, position_seed
from kvserve.shared.engine.scheduler import Batch, ScheduledSeq, Scheduler
from kvserve.shared.engine.sequence import FinishReason, SeqId, Sequence, SequenceStatus
from kvserve.shared.engine.step_threads import StepThreads
from kvserve.shared.model.llama import LlamaModel
from kvserve.shared.model.loader import LoadedWeights, load_weights
from kvserve.shared.model.quantized import QuantizedWeight
from kvserve.shared.model.tokenizer import IncrementalDetokenizer, KVTokenizer
from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams
from kvserve.shared.store.codec import BlockMeta
from kvserve.shared.store.hashing import BlockHash, InvalidSaltError, validate_cache_salt
from kvserve.shared.store.tiers import KVTail

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    root_hash: BlockHash | None = None
    completions: dict[int, Completion] = field(default_factory=dict)
    beam: BeamGroup | None = None
    export_tail: bool = False
    kv_tail: KVTail | None = None
    # The sampling seed: the client's, or one drawn here (every token is drawn with its own
    # generator seed derived from it: sampler.position_seed).
    seed: int = field(default_factory=lambda: random.getrandbits(62))

    @property
    def finished(self) -> bool:
        return len(self.completions) == self.params.n and all(
            c.seq.is_finished for c in self.completions.values()
        )


@contextlib.contextmanager
def _timed(into: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into[name] = time.perf_counter() - t0


def kept_formats(config: EngineConfig) -> frozenset[str]:
    """The GGUF block formats the linear layers keep (EngineConfig.weights); `file` where none
    can be kept is a ValueError."""
    gguf = str(config.model_path).endswith(".gguf")
    if config.file_weights_possible and gguf and cpu_qlinear.available():
        return frozenset(cpu_qlinear.FORMATS)
    if config.weights == "file":
        why = "not a GGUF file" if not gguf else "no compiled CPU kernels"
        raise ValueError(f"weights 'file': the file's blocks cannot be used ({why})")
    return frozenset()


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
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded, model = self._load_model(weights, tokenizer)
        self.model_config: ModelConfig = loaded.config
        self.max_model_len = loaded.config.max_position_embeddings
        self.kv = self._kv_cache_manager(loaded.config)
        self.block_size = self.kv.block_size
        backend = get_backend(config.attention_backend, config.device)
        on_cpu = torch.device(config.device).type == "cpu"
        self.step_threads = StepThreads(torch.get_num_threads(), enabled=on_cpu)
        self.runner = ModelRunner(model, self.kv.cache, backend)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.sampler = Sampler()
        self.eos_token_ids = set(loaded.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_steps = 0
        # n > 1 siblings created while their parent's row is sampled, forked right after.
        self._pending_children: dict[tuple[SeqId, int], Sequence] = {}

    def _load_model(
        self, weights: LoadedWeights | None, tokenizer: KVTokenizer | None
    ) -> tuple[LoadedWeights, LlamaModel]:
        """Weights, tokenizer and kernels, each a timed part of start-up."""
        config, phase = self.config, functools.partial(_timed, self.startup_s)
        with phase("kernel_load"):
            if torch.device(config.device).type == "cpu":
                cpp_build.extension()
        with phase("model_read"):
            loaded = weights or load_weights(
                config.model_path, DTYPES[config.dtype], kept_formats(config)
            )
        matmul = config.resolved_matmul_dtype
        # Other matmul numerics give other K/V: such blocks must not meet in a shared store.
        self.model_fingerprint = (
            loaded.fingerprint
            if matmul == config.dtype
            else hashlib.sha256(f"{loaded.fingerprint}/matmul={matmul}".encode()).hexdigest()
        )
        with phase("tokenizer"):
            self.tokenizer = tokenizer or KVTokenizer.from_path(config.model_path)
        with phase("weight_packing"):
            # Weights go to the device first: the model prepacks them for that device.
            on_device = {
                k: v if isinstance(v, QuantizedWeight) else v.to(config.device)
                for k, v in loaded.weights.items()
            }
            model = LlamaModel(loaded.config, on_device, DTYPES[matmul]).eval()
        if model.int8_activations:  # other K/V than the fp32 expansion's: other store keys
            digest = f"{self.model_fingerprint}/activations=int8".encode()
            self.model_fingerprint = hashlib.sha256(digest).hexdigest()
        return loaded, model

    def _kv_cache_manager(self, model: ModelConfig) -> KVCacheManager:
        """The KV cache (its memory reserved) and the tiers behind it."""
        cc, phase = self.config.cache, functools.partial(_timed, self.startup_s)
        kv_dtype = resolve_kv_dtype(cc.kv_dtype, DTYPES[self.config.dtype])
        num_blocks = cc.num_blocks or max(
            1, cc.memory_budget_bytes // (kv_bytes_per_token(model, kv_dtype) * cc.block_size)
        )
        with phase("kv_cache"):
            cache = KVCache(
                model, num_blocks, cc.block_size, kv_dtype, self.config.device, cc.populate
            )
        kv_format = str(kv_dtype).removeprefix("torch.")
        meta = BlockMeta(
            self.model_fingerprint,
            kv_format,
            cc.block_size,
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
        )
        with phase("store") if self.config.store.url else contextlib.nullcontext():
            return KVCacheManager(
                cache,
                KVIdentity(meta, self.tokenizer.fingerprint),
                enable_caching=cc.enable_prefix_caching,
                store=self.config.store,
            )

    def close(self) -> None:
        """Write out queued blocks and close the store. The engine is unusable afterwards."""
        self.kv.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def root_hash(self, cache_salt: str | None = None) -> BlockHash:
        return self.kv.identity.root_hash(cache_salt)

    def warmup(
        self, prefix: Seq[int], cache_salt: str | None = None, request_id: str = "warmup"
    ) -> dict[str, int]:
        """A shared-prefix warm-up job for one prefix: compute its full blocks unless the
        store already holds them all, publish what the store lacks, and pin them in the store
        and the host tier. Runs on the engine's thread (it steps the engine). Returns
        {"blocks", "computed" (0 or 1), "published", "skipped" (0 or 1)}."""
        if self.kv.connector is None:
            raise RuntimeError("warm-up needs a prefix store (EngineConfig.store.url)")
        hashes = self.kv.prefix_hashes(prefix, cache_salt)
        if not hashes:
            raise InvalidRequestError("prefix", f"a prefix needs at least {self.block_size} tokens")
        skipped = all(self.kv.stored(hashes))
        if not skipped:
            self.add_request(request_id, prefix, SamplingParams(max_tokens=1), cache_salt)
            while request_id in self._requests:
                self.step()
        published = self.kv.pin(prefix, hashes, cache_salt)
        return {
            "blocks": len(hashes),
            "computed": int(not skipped),
            "published": published,
            "skipped": int(skipped),
        }

    def reset_prefix_cache(self) -> dict[str, int]:
        """Drop the device prefix cache's unreferenced blocks and the whole host tier (like
        vLLM's reset_prefix_cache); blocks running requests hold, and the store, stay. Runs on
        the engine's thread. Returns {"device_blocks", "host_blocks"} dropped."""
        return self.kv.reset()

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
        if -(-total // self.block_size) > self.kv.pool.num_blocks:
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
        resume: Mapping[int, Emitted] | None = None,
    ) -> None:
        """Queue a request. Requests with different `cache_salt`s never share a block.

        Disaggregation: `export_tail` (prefill side) puts the prompt's partial last block on
        the finished output (`RequestOutput.kv_tail`); `kv_tail` (decode side) is that block,
        used instead of recomputing it when every full block before it is cached or stored.

        Exact-token resumption: `resume` maps a completion index to what the client already
        received of it from a worker that died mid-request. Each such completion continues
        from its last token (prompt + those tokens are prefilled, from the cache or the store
        where they are there; `max_tokens`, stop strings and positions count the whole
        completion; with the same seed it draws what the first worker would have drawn); one
        that finished there stays finished. A beam search emits nothing before it ends, so it
        runs again from the start."""
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"duplicate request id {request_id!r}")
        self.validate(prompt_token_ids, params)
        try:
            validate_cache_salt(cache_salt)
        except InvalidSaltError as e:
            raise InvalidRequestError("cache_salt", str(e)) from e
        prompt = list(prompt_token_ids)
        req = _Request(request_id, prompt, params, root_hash=self.root_hash(cache_salt))
        if params.seed is not None:
            req.seed = params.seed
        req.export_tail = export_tail
        if resume and params.beam_width == 1:
            self._requests[request_id] = req
            self._resume(req, resume)
            return
        seq = self._new_seq(req, 0, prompt)
        seq.kv_tail = kv_tail
        seq.pending_forks = params.n - 1
        if params.beam_width > 1:
            req.beam = BeamGroup(self._beam_search(params), [seq])
        self._requests[request_id] = req
        if not self.kv.start_fetch(seq):
            self.scheduler.add(seq)

    def _resume(self, req: _Request, resume: Mapping[int, Emitted]) -> None:
        fetching = False
        for index in range(req.params.n):
            emitted = resume.get(index, Emitted([]))
            seq = self._new_seq(req, index, req.prompt + list(emitted.token_ids))
            req.completions[index].prime(emitted)
            if req.params.logprobs:  # positions already sent: never sent again
                seq.logprobs = [0.0] * len(emitted.token_ids)
                seq.top_logprobs = [{} for _ in emitted.token_ids]
            if emitted.finished or seq.num_output_tokens >= req.params.max_tokens:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = FinishReason.STOP if emitted.finished else FinishReason.LENGTH
            elif fetching:  # one store fetch per request: the others share its blocks
                self.scheduler.add(seq)
            else:
                fetching = self.kv.start_fetch(seq)
                if not fetching:
                    self.scheduler.add(seq)

    def _beam_search(self, params: SamplingParams) -> BeamSearch:
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        return BeamSearch(
            params.beam_width,
            params.max_tokens,
            eos,
            params.length_penalty,
            params.early_stopping,
        )

    def _new_seq(self, req: _Request, index: int, token_ids: list[int]) -> Sequence:
        params = req.params
        gen = None if params.greedy else torch.Generator()
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
        req.completions[index] = Completion(
            seq, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        )
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once. False if it is unknown or finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.kv.cancel_fetch(request_id)
        beams = req.beam.seqs if req.beam is not None else []
        for seq in [c.seq for c in req.completions.values()] + beams:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- stats ----------------------------------------------------------------------------

    @property
    def prefix_cache_stats(self) -> dict[str, int]:
        """Prefix-cache lookups and hits in tokens (by source), cached and evicted blocks."""
        sched = self.scheduler
        return {
            "queries_tokens": sched.prefix_query_tokens,
            "hits_tokens": sched.prefix_hit_tokens,
            "cached_blocks": self.kv.num_cached_blocks,
            "evicted_blocks": self.kv.pool.num_evicted,
            **{f"hits_tokens_{src}": n for src, n in sched.cached_tokens_by_source.items()},
            "host_tier_blocks": self.kv.num_host_blocks,
        }

    def store_stats(self) -> dict[str, object]:
        """The store connector's counters and the store backend's; empty without a store."""
        return self.kv.store_stats()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        for seq in self.kv.take_fetched(wait=not self.scheduler.has_work()):
            self.scheduler.add(seq)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        out, seconds = self.step_threads.run(batch.num_tokens, lambda: self.runner.run(batch))
        self._observe_prefill(batch, seconds)
        for s in batch.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.kv.publish(s.seq)
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
        prompt = sum(s.num_new_tokens for s in batch.scheduled if s.num_new_tokens > 1)
        self.kv.observe_prefill(prompt, batch.num_tokens, seconds)

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

    def _sample_row(self, seq: Sequence, sibling: int) -> SampleRow:
        if sibling >= 0:  # the sibling is created now, and samples its own first token
            req = self._requests[seq.request_id]
            child = self._new_seq(req, sibling, seq.token_ids)
            self._pending_children[(seq.seq_id, sibling)] = child
            seq = child
        gen = seq.generator
        if gen is not None:
            seed = self._requests[seq.request_id].seed
            gen.manual_seed(position_seed(seed, seq.index, seq.num_output_tokens))
        return SampleRow(seq.params, gen)

    def _fork(self, parent: Sequence, sibling: int) -> Sequence:
        child = self._pending_children.pop((parent.seq_id, sibling))
        self.kv.fork(parent, child)
        self.scheduler.add_running(child)
        return child

    # ---- beam search ----------------------------------------------------------------------

    def _beam_step(self, seqs: list[Sequence], logits: torch.Tensor, rows: list[int]) -> list[str]:
        """Stash each beam's log-softmax row; advance every beam request whose live beams all
        have theirs. Returns the requests whose search finished."""
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        ready: dict[str, _Request] = {}
        for i, row in zip(rows, logprobs, strict=True):
            req = self._requests[seqs[i].request_id]
            assert req.beam is not None
            if req.beam.stash(seqs[i], row):
                ready[req.request_id] = req
        done = []
        for rid, req in ready.items():
            assert req.beam is not None
            if req.beam.advance(self._fork_beam, self._drop_beam):
                self._finish_beam_request(req)
                done.append(rid)
        return done

    def _fork_beam(self, parent: Sequence) -> Sequence:
        child = Sequence(
            seq_id=SeqId(next(self._seq_ids)),
            request_id=parent.request_id,
            index=0,
            token_ids=list(parent.token_ids),
            num_prompt_tokens=parent.num_prompt_tokens,
            params=parent.params,
            arrival=next(self._arrivals),
            root_hash=parent.root_hash,
        )
        self.kv.fork(parent, child)
        self.scheduler.add_running(child)
        return child

    def _drop_beam(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, FinishReason.ABORT)

    def _finish_beam_request(self, req: _Request) -> None:
        """The best hypothesis becomes completion 0."""
        assert req.beam is not None
        best = req.beam.search.best()
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
            cached_tokens_by_source=dict(comp.seq.cached_tokens_by_source),
            store_lookup=comp.seq.store_lookup,
        )
        result.status = SequenceStatus.FINISHED
        ends_in_eos = bool(best.token_ids) and best.token_ids[-1] in req.beam.search.eos
        result.finish_reason = FinishReason.STOP if ends_in_eos else FinishReason.LENGTH
        comp.seq = result
        for tok in best.token_ids:
            comp.add(tok)

    # ---- tokens out -----------------------------------------------------------------------

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
        comp.add(token)
        reason = self._stop_reason(seq, comp, token)
        if reason is not None:
            req = self._requests[seq.request_id]
            if req.export_tail and seq.index == 0:
                req.kv_tail = self.kv.tail_of(seq)
            self.scheduler.finish(seq, reason)

    def _stop_reason(self, seq: Sequence, comp: Completion, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if p.stop and comp.cut_at_stop(p.stop):
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _output(self, req: _Request) -> RequestOutput:
        finished = req.finished
        hold = max((len(s) for s in req.params.stop), default=1) - 1
        deltas = [req.completions[idx].delta(idx, hold) for idx in sorted(req.completions)]
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
            cached_tokens_by_source=dict(first.cached_tokens_by_source),
            store_lookup=first.store_lookup,
        )

    # ---- outside the scheduler ------------------------------------------------------------

    @torch.inference_mode()
    def score(self, token_ids: Seq[int]) -> torch.Tensor:
        """Logits [T, vocab] (float32) at every position of `token_ids`, computed in one pass
        outside the scheduler (for perplexity and fidelity checks); changes no request."""
        self.validate(token_ids, SamplingParams(max_tokens=1))
        seq = Sequence(
            SeqId(-1), "score", 0, list(token_ids), len(token_ids), SamplingParams(), arrival=-1
        )
        blocks = self.kv.allocate_blocks(seq.blocks_needed(len(token_ids), self.block_size))
        if blocks is None:
            raise RuntimeError("not enough free KV blocks to score this sequence")
        seq.block_table = blocks
        try:
            batch = Batch(scheduled=[ScheduledSeq(seq, len(token_ids))])
            _, hidden = self.runner.forward(batch)
            return self.runner.model.compute_logits(hidden)
        finally:
            self.kv.free_blocks(blocks)

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
