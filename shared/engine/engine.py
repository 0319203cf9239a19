"""Engine: requests in, token and text deltas out, one `step()` at a time.

A step: schedule (which also admits the requests whose store fetch has landed, and with
speculative decoding gives decoding sequences their draft tokens) -> run the model -> advance
the scheduled sequences (computed tokens, newly full blocks published) -> process the outputs
(sample or advance beam searches, verify drafts, append tokens, fork n > 1 siblings, detect
stops) -> emit deltas (returned, and given to `on_outputs` when it is set). A step of plain
decodes draws its tokens and runs the next step's model call with them before the rest
(`_run_ahead`, shared/engine/run_ahead.py).

Owns the request table and the step loop. Blocks, in every tier, belong to the KVCacheManager
(`kv`); the waiting and running queues to the Scheduler; what a step's logits become to the
OutputProcessor; a beam search's live beams to its BeamGroup. Not thread-safe: one thread
drives it (see AsyncEngine for the async API).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Seq

import torch
from kvserve.kernels.backend import get_backend
from kvserve.shared.config import EngineConfig, ModelConfig
from kvserve.shared.engine.failure import (
    EngineDeadError,
    RequestFailedError,
    StepFailures,
    describe,
    inject_step_faults,
)
from kvserve.shared.engine.helper_thread import HelperThread, Pending
from kvserve.shared.engine.model_runner import ModelRunner, StepOutput
from kvserve.shared.engine.ngram_proposer import NgramProposer
from kvserve.shared.engine.output_processor import OutputProcessor
from kvserve.shared.engine.outputs import Emitted, RequestOutput
from kvserve.shared.engine.request import Request, SequenceFactory
from kvserve.shared.engine.run_ahead import steady_decodes
from kvserve.shared.engine.scheduler import Batch, ScheduledSeq, Scheduler
from kvserve.shared.engine.sequence import FinishReason, SeqId, Sequence, SequenceStatus
from kvserve.shared.engine.sim.model import SimulatedModel, fill_like_kv, load_simulated
from kvserve.shared.engine.sim.profile import StepShape
from kvserve.shared.engine.sim.runner import SimulatedRunner, word_vocabulary
from kvserve.shared.engine.sim.step_log import shape_of
from kvserve.shared.engine.sim.store import ModelledTransfers
from kvserve.shared.engine.startup import build_kv_manager, load_model
from kvserve.shared.engine.step_threads import StepThreads
from kvserve.shared.model.loader import LoadedWeights
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams
from kvserve.shared.store.backends import open_store
from kvserve.shared.store.base import BlockStore
from kvserve.shared.store.block_data import KVTail
from kvserve.shared.store.hashing import BlockHash, InvalidSaltError, validate_cache_salt
from kvserve.shared.telemetry import get_logger

log = get_logger("kvserve.engine")
OutputHook = Callable[[list[RequestOutput]], None]
StepHook = Callable[[StepShape, float], None]


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        tokenizer: KVTokenizer | None = None,
        weights: LoadedWeights | None = None,
    ) -> None:
        """`weights` and `tokenizer` may be passed in to share one load between engines.
        With `config.simulate` the engine is simulated (DESIGN.md section 2.2): no weights, the
        forward pass replaced by the cost profile's time; `self.config` then holds the
        profile's KV capacity and scheduler limits."""
        self.config = config
        faults = config.faults  # a simulated engine's config is the profile's, below
        # Seconds each part of start-up took (kvserve bench startup reports them).
        self.startup_s: dict[str, float] = {}
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.simulated: SimulatedModel | None = None
        self.runner: ModelRunner | SimulatedRunner
        if config.simulate is None:
            self._load_model(config, tokenizer, weights)
        else:
            self._load_simulated(config, tokenizer)
        config = self.config
        self.block_size = self.kv.block_size
        spec = config.speculative
        drafter = NgramProposer(spec) if spec is not None else None
        self.scheduler = Scheduler(config.scheduler, self.kv, drafter)
        self.eos_token_ids = set(self.model_config.eos_token_ids) | set(
            self.tokenizer.eos_token_ids
        )
        self._requests: dict[str, Request] = {}
        self.sequences = SequenceFactory(self.tokenizer)
        self.outputs = OutputProcessor(
            self._requests,
            self.sequences,
            self.kv,
            self.scheduler,
            self.eos_token_ids,
            self.max_model_len,
        )
        self.num_steps = 0
        # Overlapped steps: a step's outputs are made on this thread during the next model call
        # (where that call leaves a core).
        self.overlap = config.async_scheduling and config.simulate is None
        self._emitter = HelperThread("kvserve-emit")
        # A model call that ran ahead of its step's outputs (`_run_ahead`): its batch, its
        # logits and its seconds, for the next step() to finish.
        self._ahead: tuple[Batch, StepOutput, float] | None = None
        self.num_steps_ahead = 0  # model calls that ran ahead
        self.faults = faults
        self.step_failures = StepFailures(faults.max_step_failures, faults.window_s)
        self.num_step_failures = 0  # steps that failed as a whole
        self.num_failed_requests = 0  # requests failed by an exception of their own
        self.num_quarantined = 0  # requests failed after quarantine_after failed steps
        # Called with every step's outputs, whoever drives the step (AsyncEngine sets it, so
        # that steps taken inside an engine call, such as a warm-up, still deliver).
        self.on_outputs: OutputHook | None = None
        # Called with every step's shape (as scheduled) and its seconds, schedule to outputs
        # (a step log, for calibration).
        self.on_step: StepHook | None = None

    def _load_model(
        self, config: EngineConfig, tokenizer: KVTokenizer | None, weights: LoadedWeights | None
    ) -> None:
        loaded = load_model(config, self.startup_s, weights, tokenizer)
        self.tokenizer = loaded.tokenizer
        self.model_fingerprint = loaded.fingerprint
        self.model_config: ModelConfig = loaded.weights.config
        self.max_model_len = self.model_config.max_position_embeddings
        identity = (self.model_fingerprint, self.tokenizer.fingerprint)
        self.kv = build_kv_manager(config, self.model_config, identity, self.startup_s)
        backend = get_backend(config.attention_backend, config.device)
        self.on_cpu = on_cpu = torch.device(config.device).type == "cpu"
        self.step_threads = StepThreads(torch.get_num_threads(), enabled=on_cpu)
        head_threads = self.step_threads.max_threads if on_cpu else None
        self.runner = ModelRunner(loaded.model, self.kv.cache, backend, head_threads)

    def _load_simulated(self, config: EngineConfig, tokenizer: KVTokenizer | None) -> None:
        """A simulated engine: the profile's engine settings, a KV cache of its payload, the
        store's transfers modelled when the payload is small, a SimulatedRunner."""
        sim = self.simulated = load_simulated(config, tokenizer)
        self.config = config = sim.engine_config
        self.tokenizer = sim.tokenizer
        self.model_fingerprint = sim.fingerprint
        self.model_config = sim.config
        self.max_model_len = sim.config.max_position_embeddings
        identity = (self.model_fingerprint, self.tokenizer.fingerprint)
        scale = sim.time_scale

        def backend(url: str) -> BlockStore:
            store = open_store(url)
            return store if sim.true_payload else ModelledTransfers(store, sim.profile.store, scale)

        self.kv = build_kv_manager(config, sim.config, identity, self.startup_s, backend)
        if sim.true_payload:
            fill_like_kv(self.kv.cache)
        self.on_cpu = True
        self.step_threads = StepThreads(torch.get_num_threads(), enabled=False)
        words = word_vocabulary(sim.tokenizer)
        self.runner = SimulatedRunner(sim.profile, self.kv.cache, words, scale)

    @property
    def model_runner(self) -> ModelRunner:
        """The runner of the real model (RuntimeError in a simulated engine, which has none)."""
        if not isinstance(self.runner, ModelRunner):
            raise RuntimeError("a simulated engine runs no model")
        return self.runner

    def close(self) -> None:
        """Write out queued blocks and close the store. The engine is unusable afterwards."""
        self._emitter.shutdown()
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
        if not self.kv.has_store:
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
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:  # C loops, not Python
            raise InvalidRequestError("prompt", f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the context window of {self.max_model_len} tokens",
            )
        if params.fault is not None and not self.faults.injection:
            raise InvalidRequestError(
                "fault", "fault injection is off (a server started with --enable-fault-injection)"
            )
        if -(-total // self.block_size) > self.kv.num_blocks:
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
        req = Request(request_id, prompt, params, root_hash=self.root_hash(cache_salt))
        if params.seed is not None:
            req.seed = params.seed
        req.export_tail = export_tail
        if resume and params.beam_width == 1:
            self._requests[request_id] = req
            self._resume(req, resume)
            return
        seq = self.sequences.completion(req, 0, prompt)
        seq.kv_tail = kv_tail
        seq.pending_forks = params.n - 1
        if params.beam_width > 1:
            req.beam = self.outputs.beam_group(params, seq)
        self._requests[request_id] = req
        self.scheduler.add(seq)

    def _resume(self, req: Request, resume: Mapping[int, Emitted]) -> None:
        fetching = False
        for index in range(req.params.n):
            emitted = resume.get(index, Emitted([]))
            seq = self.sequences.completion(req, index, req.prompt + list(emitted.token_ids))
            req.completions[index].prime(emitted)
            if req.params.logprobs:  # positions already sent: never sent again
                seq.logprobs = [0.0] * len(emitted.token_ids)
                seq.top_logprobs = [{} for _ in emitted.token_ids]
            if emitted.finished or seq.num_output_tokens >= req.params.max_tokens:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = FinishReason.STOP if emitted.finished else FinishReason.LENGTH
            else:  # one store fetch per request: the others share its blocks
                self.scheduler.add(seq, fetch=not fetching)
                fetching = fetching or seq.status is SequenceStatus.FETCHING

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once. False if it is unknown or finished."""
        req = self._requests.pop(request_id, None)
        self.scheduler.forget(request_id)
        if req is None:
            return False
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
        sched, kv = self.scheduler, self.kv.stats()
        return {
            "queries_tokens": sched.prefix_query_tokens,
            "hits_tokens": sched.prefix_hit_tokens,
            "cached_blocks": kv["cached_blocks"],
            "evicted_blocks": kv["evicted_blocks"],
            **{f"hits_tokens_{src}": n for src, n in sched.cached_tokens_by_source.items()},
            "host_tier_blocks": kv["host_tier_blocks"],
        }

    @property
    def spec_decode_stats(self) -> dict[str, int]:
        """Speculative decoding: verification steps of sequences with drafts, draft tokens
        verified, drafts accepted (all 0 without speculation)."""
        spec = self.outputs.spec_decode
        return {
            "num_drafts": spec.num_drafts,
            "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
        }

    def store_stats(self) -> dict[str, object]:
        """The store connector's counters and the store backend's; empty without a store."""
        return self.kv.store_stats()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step; a request whose own processing raised fails alone, a step that failed as
        a whole requeues (or quarantines) its requests (shared/engine/failure.py). Raises
        EngineDeadError when too many steps failed in a short time.

        Overlapped (`async_scheduling`): the step's outputs (text, deltas, delivery) are made
        as the next step's model call begins, on the emitter thread while it runs where the
        call leaves a core (`_spare_core`), and returned by that step (or by the next step()
        that has nothing to run, at once). A step of plain decodes goes further and runs the
        next model call before its outputs are made (`_run_ahead`); that call's step ends in
        the next step(), which runs a scheduled step after it unless it ran ahead again. Each
        step() runs at most one model call, and one whenever a request can run."""
        started = time.perf_counter()
        ended: list[RequestOutput] = []
        if self._ahead is not None:  # a model call ran ahead: its step ends here
            batch, out, seconds = self._ahead
            self._ahead = None
            ended = self._end_step(batch, out, seconds)
            if self._ahead is not None:  # the next call ran ahead of its outputs
                return ended
        self.runner.begin_step()
        try:
            batch = self.scheduler.schedule()
        except Exception as e:
            return ended + self._emit() + self._step_failed(Batch(), e)
        if not batch:
            return ended + self._emit()
        shape = shape_of(batch) if self.on_step is not None else None
        emitted: list[RequestOutput] = []
        emitting: list[Pending[list[RequestOutput]]] = []

        def launched() -> None:  # the model call begins: the last step's outputs meanwhile
            if not self.outputs.has_unemitted:
                return
            if self._spare_core():
                emitting.append(self._emitter.submit(self._emit))
            else:
                emitted.extend(self._emit())

        try:
            if self.faults.injection:
                inject_step_faults(s.seq.params for s in batch.scheduled)
            out, seconds = self.step_threads.run(
                batch.num_tokens, lambda: self.runner.run(batch, launched)
            )
        except Exception as e:
            emitted += emitting[0].result() if emitting else []
            return ended + emitted + self._step_failed(batch, e)
        emitted += emitting[0].result() if emitting else []
        outputs = self._end_step(batch, out, seconds, may_run=False)
        if self.on_step is not None and shape is not None:
            self.on_step(shape, time.perf_counter() - started)
        return ended + emitted + outputs

    def _end_step(
        self, batch: Batch, out: StepOutput, seconds: float, may_run: bool = True
    ) -> list[RequestOutput]:
        """The model call ran: advance the batch and make its outputs; or, for a step of
        plain decodes, draw its tokens and run the next model call with them first, or
        (not `may_run`: this step() has run its call) leave that to the next step()."""
        failed = self._take_failed()  # requests that failed while they were emitted
        if failed or any(s.seq.is_finished for s in batch.scheduled):  # or finished, ahead
            batch, out = batch.without_finished(), out.without_finished()
        if self._may_run_ahead() and steady_decodes(
            batch, out, self.scheduler, self._requests, self.block_size, self.max_model_len
        ):
            self._deliver(failed)
            if not may_run:
                self._ahead = (batch, out, seconds)
                return failed
            return failed + self._run_ahead(batch, out, seconds)
        self.scheduler.advance(batch, seconds)
        self.num_steps += 1
        outputs = self.outputs.process(out, self.overlap) if out.sampling_seqs else []
        outputs += failed + self._take_failed()
        self._deliver(outputs)
        self.runner.end_step()
        return outputs

    def _may_run_ahead(self) -> bool:
        """Overlapped steps, not timed shape by shape (calibration), no faults injected."""
        return self.overlap and self.on_step is None and not self.faults.injection

    def _run_ahead(self, batch: Batch, out: StepOutput, seconds: float) -> list[RequestOutput]:
        """vLLM's async scheduling for a step of plain decodes: draw its tokens, then run the
        next step's model call with them at once; the step's own outputs (the batch advanced,
        the tokens appended, stops, text, deltas) are made while that call runs, on the
        emitter where it leaves a core. The call's logits wait for the next step(), which
        drops the rows of sequences that stopped meanwhile. Returns this step's outputs."""
        drawn = self.outputs.draw(out)
        ahead = Batch([ScheduledSeq(s.seq, 1) for s in batch.scheduled])
        tokens = [d[0] if d is not None else 0 for d in drawn]  # 0: a failed row, dropped
        argmax = all(s.seq.params.greedy and not s.seq.params.top_logprobs for s in ahead.scheduled)
        emitting: Pending[list[RequestOutput]] | None = None
        made: list[RequestOutput] | None = None  # made on this thread, as the call began

        def finish() -> list[RequestOutput]:
            self.scheduler.advance(batch, seconds)
            self.num_steps += 1
            outputs = self.outputs.apply(out, drawn)
            self._deliver(outputs)
            self.model_runner.prebuild_ahead(ahead)  # the step after next, if it runs ahead
            return outputs

        def launched() -> None:
            nonlocal emitting, made
            if self._spare_core():
                emitting = self._emitter.submit(finish)
            else:
                made = finish()

        def finished() -> list[RequestOutput]:
            """This step's outputs, wherever they were made (now, if the call failed first)."""
            if emitting is not None:
                return emitting.result()
            return made if made is not None else finish()

        self.runner.end_step()
        self.runner.begin_step()
        try:
            next_out, next_seconds = self.step_threads.run(
                ahead.num_tokens,
                lambda: self.model_runner.run_ahead(ahead, tokens, launched, argmax),
            )
        except Exception as e:
            return finished() + self._deliver_failed() + self._step_failed(ahead, e)
        outputs = finished() + self._deliver_failed()
        self.num_steps_ahead += 1
        self._ahead = (ahead, next_out, next_seconds)
        return outputs

    def _spare_core(self) -> bool:
        """Whether the model call now starting leaves the emitter a core of its own: on a GPU,
        or on the CPU when the step computes on fewer threads than the engine has (a thread
        more would preempt one of the step's, and every other one waits for it)."""
        return not self.on_cpu or torch.get_num_threads() < self.step_threads.max_threads

    def _emit(self) -> list[RequestOutput]:
        """What the last overlapped step left: its outputs, made and delivered."""
        if not self.outputs.has_unemitted:
            return []
        outputs = self.outputs.emit()
        self._deliver(outputs)
        return outputs

    def _take_failed(self) -> list[RequestOutput]:
        """Each request whose own processing raised, failed (aborted; its error output)."""
        outputs = []
        for rid, error in self.outputs.take_failed().items():
            log.error("request failed", request_id=rid, exc_info=error)
            outputs.append(self._fail_request(rid, "internal_error", error))
        return outputs

    def _deliver_failed(self) -> list[RequestOutput]:
        """`_take_failed`'s outputs, delivered."""
        failed = self._take_failed()
        self._deliver(failed)
        return failed

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self.on_outputs is not None and outputs:
            self.on_outputs(outputs)

    def _step_failed(self, batch: Batch, error: Exception) -> list[RequestOutput]:
        """No request to blame: the step's requests go back to the queue to be computed again
        (their blocks freed; published blocks stay cached), each to run alone in its next step;
        those in `quarantine_after` failed steps fail instead."""
        rids = list(dict.fromkeys(s.seq.request_id for s in batch.scheduled))
        log.error("engine step failed", requests=rids, exc_info=error)
        self.num_step_failures += 1
        if self.step_failures.record():
            raise EngineDeadError(
                f"{self.step_failures.limit} steps failed within {self.faults.window_s:g} s"
            ) from error
        condemned = self.scheduler.fail_step(batch, self.faults.quarantine_after)
        outputs = [
            self._fail_request(rid, "quarantined", error)
            for rid in condemned
            if rid in self._requests
        ]
        self._deliver(outputs)
        self.runner.end_step()
        return outputs

    def _fail_request(self, request_id: str, kind: str, error: BaseException) -> RequestOutput:
        """Abort the request (its blocks freed) and make its last output: an error."""
        req = self._requests[request_id]
        self.abort_request(request_id)
        if kind == "quarantined":
            self.num_quarantined += 1
        else:
            self.num_failed_requests += 1
        failure = RequestFailedError(request_id, kind, describe(error))
        return RequestOutput(request_id, req.prompt, 0, [], True, error=failure)

    # ---- outside the scheduler ------------------------------------------------------------

    @torch.inference_mode()
    def score(self, token_ids: Seq[int]) -> torch.Tensor:
        """Logits [T, vocab] (float32) at every position of `token_ids`, computed in one pass
        outside the scheduler (for perplexity and fidelity checks); changes no request."""
        self.validate(token_ids, SamplingParams(max_tokens=1))
        runner = self.model_runner
        seq = Sequence(
            SeqId(-1), "score", 0, list(token_ids), len(token_ids), SamplingParams(), arrival=-1
        )
        blocks = self.kv.allocate_blocks(seq.blocks_needed(len(token_ids), self.block_size))
        if blocks is None:
            raise RuntimeError("not enough free KV blocks to score this sequence")
        seq.block_table = blocks
        try:
            batch = Batch(scheduled=[ScheduledSeq(seq, len(token_ids))])
            _, hidden = runner.forward(batch)
            return runner.model.compute_logits(hidden)
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
        ids = [f"gen-{os.getpid()}-{self.sequences.next_id()}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        results: dict[str, dict[int, list[int]]] = {rid: {} for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.error is not None:
                    raise out.error
                for d in out.completions:
                    results[out.request_id].setdefault(d.index, []).extend(d.token_ids)
        return [[results[rid][i] for i in sorted(results[rid])] for rid in ids]
