"""Iteration-level scheduler with chunked prefill and preemption by recompute.

Each `schedule()` fills one step's token budget: first the running sequences, oldest first (a
decode takes 1 token, an unfinished prompt a chunk), then waiting sequences in arrival order while
blocks and the budget allow. When a running sequence needs a block and none is free, the newest
running sequence is preempted: its blocks are freed, `num_computed_tokens` drops to 0 and it goes
back to the front of the waiting queue to be recomputed (prompt and tokens generated so far).
No waiting sequence is admitted in a step that preempted.

A sequence whose prefix blocks are being fetched from the store waits in the same queue, in
status FETCHING: it keeps its place and is passed over until its blocks have landed.

Speculative decoding (with a Drafter): once every running sequence has its tokens, each one in
the decode state gets draft tokens (`Sequence.draft_tokens`) while the budget and free blocks
allow, and its chunk grows by them; a draft never costs anyone a block (a step that preempted
drafts nothing), and a preempted sequence loses its drafts. `advance` counts only the real
tokens as computed: the verification (OutputProcessor) adds the drafts it accepts.

Owns: the waiting queue and the running list. Mutates: sequences' `num_computed_tokens` and
status. Sees the KV cache only through `KVSlots` (what it may ask of the KV-cache manager):
blocks come from it and go back to it: `start_fetch` when a sequence arrives, `match_prefix`
at admission, `allocate_slots` for each step's tokens, `publish` after it, `free` on
preemption and finish.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.shared.config import SchedulerConfig
from kvserve.shared.engine.sequence import (
    BlockId,
    FinishReason,
    Sequence,
    SequenceStatus,
)
from kvserve.shared.store.hashing import BlockHash


class KVSlots(Protocol):
    """The KV cache as the scheduler sees it (implemented by KVCacheManager): a sequence's
    block table and counters live on the Sequence; everything else stays behind this."""

    @property
    def caching(self) -> bool: ...

    def start_fetch(self, seq: Sequence) -> bool:
        """Ask the store for the prompt's uncached blocks; True: park it until they land."""
        ...

    def take_fetched(self, wait: bool) -> list[Sequence]:
        """Parked sequences whose store lookup has ended (waiting briefly with `wait`)."""
        ...

    def cancel_fetch(self, request_id: str) -> None: ...

    def match_prefix(self, seq: Sequence) -> None:
        """Attach the longest cached prefix (sets block_table and num_computed_tokens)."""
        ...

    def allocate_slots(self, seq: Sequence, n: int) -> list[tuple[BlockId, BlockId]] | None:
        """Blocks for `n` more tokens (None: none free); the copy-on-write copies to make."""
        ...

    def free(self, seq: Sequence) -> None: ...

    def publish(self, seq: Sequence) -> None:
        """Index the sequence's newly computed full blocks."""
        ...

    def observe_prefill(self, prompt_tokens: int, step_tokens: int, seconds: float) -> None: ...


class Drafter(Protocol):
    """Where draft tokens come from (NgramProposer)."""

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """At most `limit` tokens that may follow `seq`'s (none: a plain decode)."""
        ...


@dataclass(frozen=True)
class ScheduledSeq:
    """`num_new_tokens` of `seq` in this step, the last `num_drafts` of them its draft tokens
    (then every one of the chunk's rows is sampled, to verify them)."""

    seq: Sequence
    num_new_tokens: int
    num_drafts: int = 0

    @property
    def samples(self) -> bool:
        """Whether this step brings the sequence up to date, so its last logits are sampled."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens == seq.num_tokens + self.num_drafts


@dataclass
class Batch:
    """One step's work. `block_copies` (src, dst) must run before the forward pass."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[BlockId, BlockId]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)

    def without_finished(self) -> Batch:
        """The batch less the sequences that finished since it was scheduled (a request that
        failed while the step ran): their blocks are freed, nothing of theirs is kept."""
        live = [s for s in self.scheduled if not s.seq.is_finished]
        return Batch(live, self.block_copies, self.preempted)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVSlots, drafter: Drafter | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.drafter = drafter
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prefix-cache accounting in tokens, counted at a request's first admission.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.cached_tokens_by_source: dict[str, int] = {"device": 0, "host": 0, "store": 0}
        # Requests of a step that failed as a whole: each runs alone in its next step (so that
        # a second failure has one request to blame) until one of its steps succeeds; and how
        # many failed steps each has been in since its last successful one.
        self.suspects: set[str] = set()
        self.failed_steps: dict[str, int] = {}

    def add(self, seq: Sequence, fetch: bool = True) -> None:
        """Queue a new sequence; with `fetch`, it first asks the store for the prompt blocks
        the local tiers lack (FETCHING until they land)."""
        parked = fetch and self.kv.start_fetch(seq)
        seq.status = SequenceStatus.FETCHING if parked else SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sequence (n > 1 sibling, beam) whose blocks are already shared."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        """Is there anything a step could run now (not counting parked sequences)?"""
        return bool(self.running) or any(s.status is SequenceStatus.WAITING for s in self.waiting)

    def schedule(self) -> Batch:
        for seq in self.kv.take_fetched(wait=not self.has_work()):
            seq.status = SequenceStatus.WAITING
        if self.suspects:
            alone = self._schedule_suspect()
            if alone:
                return alone
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n == 0:
                i += 1
                continue
            while not self._reserve(seq, n, batch):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            break
        if not batch.preempted:
            if self.drafter is not None:
                budget -= self._add_drafts(batch, budget)
            self._admit(batch, budget)
        return batch

    def _add_drafts(self, batch: Batch, budget: int) -> int:
        """Drafts for the batch's decoding sequences, oldest first, while `budget` lasts and
        their blocks are free; the tokens they add."""
        assert self.drafter is not None
        added = 0
        for i, s in enumerate(batch.scheduled):
            seq = s.seq
            room = budget - added
            if room <= 0:
                break
            if s.num_new_tokens != 1 or seq.num_computed_tokens + 1 != seq.num_tokens:
                continue
            drafts = self.drafter.propose(seq, room)
            if not drafts or not self._reserve(seq, 1 + len(drafts), batch):
                continue
            seq.draft_tokens = drafts
            batch.scheduled[i] = ScheduledSeq(seq, 1 + len(drafts), len(drafts))
            added += len(drafts)
        return added

    def _schedule_suspect(self) -> Batch:
        """A batch of the first waiting suspect alone (empty when none can run now)."""
        batch = Batch()
        seq = next((s for s in self.waiting if s.request_id in self.suspects), None)
        if seq is None or seq.status is not SequenceStatus.WAITING:
            return batch
        if seq.num_computed_tokens == 0 and self.kv.caching:
            self.kv.match_prefix(seq)
        n = self._chunk(seq, self.config.max_num_batched_tokens)
        if n == 0 or not self._reserve(seq, n, batch):
            self._unmatch(seq)
            return Batch()
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.scheduled.append(ScheduledSeq(seq, n))
        return batch

    def _admit(self, batch: Batch, budget: int) -> None:
        """Admit waiting sequences in arrival order while blocks and the budget allow. With
        prefix caching, a sequence whose next uncached block is being computed right now by a
        running sequence waits for it (in-batch prefix sharing) instead of computing it twice;
        later arrivals may go ahead of it."""
        inflight = self._inflight_hashes() if self.kv.caching else set()
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            if seq.status is SequenceStatus.FETCHING or seq.request_id in self.suspects:
                deferred.append(seq)  # a suspect runs alone (_schedule_suspect)
                continue
            if seq.num_computed_tokens == 0 and self.kv.caching:
                self.kv.match_prefix(seq)
                nxt = len(seq.block_table)
                if nxt < len(seq.block_hashes) and seq.block_hashes[nxt] in inflight:
                    self._unmatch(seq)
                    deferred.append(seq)
                    continue
            n = self._chunk(seq, budget)
            if n == 0 or not self._reserve(seq, n, batch):
                self._unmatch(seq)  # give back a prefix hit rather than sit on it
                self.waiting.appendleft(seq)
                break
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
                self.prefix_query_tokens += seq.num_tokens
                self.prefix_hit_tokens += seq.num_computed_tokens
                for src, hit in seq.cached_tokens_by_source.items():
                    self.cached_tokens_by_source[src] += hit
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            inflight.update(seq.block_hashes[seq.num_published :])
            batch.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def _inflight_hashes(self) -> set[BlockHash]:
        """Hashes of full blocks that running sequences will compute but have not published."""
        out: set[BlockHash] = set()
        for seq in self.running:
            out.update(seq.block_hashes[seq.num_published :])
        return out

    def _unmatch(self, seq: Sequence) -> None:
        if seq.block_table:
            self.kv.free(seq)
            seq.num_computed_tokens = 0

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_tokens - seq.num_computed_tokens, budget, self.config.max_prefill_chunk)

    def _reserve(self, seq: Sequence, n: int, batch: Batch) -> bool:
        """Blocks for `seq`'s next `n` tokens (all or nothing); copy-on-write copies go on the
        batch."""
        copies = self.kv.allocate_slots(seq, n)
        if copies is None:
            return False
        batch.block_copies += copies
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.requeue(seq)
        self.num_preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """Put a running sequence back at the head of the queue, to be computed again from its
        tokens (its blocks freed; those it published stay cached)."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_tokens = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def advance(self, batch: Batch, seconds: float) -> None:
        """The step ran: each scheduled sequence's computed tokens catch up, its newly full
        blocks are published, and the prefill-speed estimate learns the step's time. Draft
        tokens are not counted: which of them hold good K/V only their verification knows."""
        prompt = sum(
            s.num_new_tokens for s in batch.scheduled if s.num_new_tokens > 1 and not s.num_drafts
        )
        self.kv.observe_prefill(prompt, batch.num_tokens, seconds)
        for s in batch.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens - s.num_drafts
            self.kv.publish(s.seq)
            if self.suspects:
                self.forget(s.seq.request_id)

    def fail_step(self, batch: Batch, limit: int) -> list[str]:
        """The step ran into an error no request can be blamed for: each of its requests
        counts a failed step; those at `limit` are returned (for the engine to fail), the
        others' sequences go back to the queue, as suspects."""
        rids = list(dict.fromkeys(s.seq.request_id for s in batch.scheduled))
        condemned = []
        for rid in rids:
            failed = self.failed_steps[rid] = self.failed_steps.get(rid, 0) + 1
            if failed >= limit:
                condemned.append(rid)
            else:
                self.suspects.add(rid)
        for s in batch.scheduled:
            if s.seq.request_id in self.suspects and s.seq.status is SequenceStatus.RUNNING:
                self.requeue(s.seq)
        return condemned

    def forget(self, request_id: str) -> None:
        """The request is cleared of suspicion (a step of its succeeded) or gone."""
        self.suspects.discard(request_id)
        self.failed_steps.pop(request_id, None)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish (or abort) a sequence wherever it is; its blocks are freed at once (and a
        store fetch it waits for is cancelled)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            if seq.status is SequenceStatus.FETCHING:
                self.kv.cancel_fetch(seq.request_id)
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
