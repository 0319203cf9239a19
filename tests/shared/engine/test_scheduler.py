"""Scheduler on its own: a KVCacheManager over a one-layer cache (prefix caching off), hand-made
Sequences, no model.

A step is simulated as the Engine does it: every scheduled sequence advances
`num_computed_tokens` by its `num_new_tokens`, and those whose `samples` was true get a token.
Block ids and orders are exact: the pool hands out blocks from the front of its free list.
"""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvserve.shared.config import SchedulerConfig
from kvserve.shared.engine.kv.cache import KVCache
from kvserve.shared.engine.kv.manager import KVCacheManager, KVIdentity
from kvserve.shared.engine.scheduler import Batch, Scheduler
from kvserve.shared.engine.sequence import (
    BlockId,
    FinishReason,
    Sequence,
    SequenceStatus,
)
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.codec import BlockMeta

from tests.shared.engine.helpers import prompt_sequence
from tests.shared.model_configs import model_config

NEXT_TOKEN = 7


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 16) -> Sequence:
    return prompt_sequence(
        seq_id, range(100, 100 + prompt_len), SamplingParams(max_tokens=max_tokens)
    )


def make_scheduler(
    num_blocks: int,
    block_size: int = 4,
    max_num_batched_tokens: int = 16,
    max_prefill_chunk: int = 512,
    max_num_seqs: int = 128,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_prefill_chunk=max_prefill_chunk,
    )
    model = model_config(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4)
    cache = KVCache(model, num_blocks, block_size, torch.float32)
    identity = KVIdentity(BlockMeta("test-model", "float32", block_size, 1, 1, 4), "test-tok")
    return Scheduler(cfg, KVCacheManager(cache, identity, enable_caching=False))


def plan(batch: Batch) -> list[tuple[int, int]]:
    """(seq_id, num_new_tokens) in scheduled order."""
    return [(s.seq.seq_id, s.num_new_tokens) for s in batch.scheduled]


def simulate(batch: Batch) -> list[Sequence]:
    """Apply one step as the Engine would; returns the sequences that sampled a token.
    (`ScheduledSeq.samples` reads `num_computed_tokens`: it must be read before the update.)"""
    sampled = [s.seq for s in batch.scheduled if s.samples]
    for s in batch.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
    for seq in sampled:
        seq.token_ids.append(NEXT_TOKEN)
    return sampled


def step(sched: Scheduler) -> Batch:
    batch = sched.schedule()
    simulate(batch)
    return batch


def fork(sched: Scheduler, parent: Sequence, seq_id: int) -> Sequence:
    """An n > 1 sibling, as the Engine forks it: same tokens and table, blocks shared."""
    child = make_seq(seq_id, parent.num_prompt_tokens)
    child.token_ids = list(parent.token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    child.block_table = list(parent.block_table)
    sched.kv.pool.share(child.block_table)
    sched.add_running(child)
    return child


def b(*xs: int) -> list[BlockId]:
    return [BlockId(x) for x in xs]


def test_admission_in_arrival_order() -> None:
    sched = make_scheduler(num_blocks=8)
    a, bb, c = make_seq(0, 5), make_seq(1, 3), make_seq(2, 6)
    for s in (a, bb, c):
        sched.add(s)
    batch = sched.schedule()
    assert plan(batch) == [(0, 5), (1, 3), (2, 6)]
    assert [s.samples for s in batch.scheduled] == [True, True, True]
    assert a.block_table == b(0, 1)
    assert bb.block_table == b(2)
    assert c.block_table == b(3, 4)
    assert sched.running == [a, bb, c]
    assert not sched.waiting
    assert all(s.status is SequenceStatus.RUNNING for s in (a, bb, c))
    assert sched.kv.pool.free_block_ids() == b(5, 6, 7)
    assert batch.block_copies == [] and batch.preempted == []


def test_chunked_prefill_takes_16_16_8() -> None:
    sched = make_scheduler(num_blocks=8, block_size=16, max_num_batched_tokens=16)
    seq = make_seq(0, 40)
    sched.add(seq)
    chunks, tables, samples = [], [], []
    for _ in range(3):
        batch = sched.schedule()
        chunks.append(plan(batch))
        samples.append(batch.scheduled[0].samples)
        simulate(batch)
        tables.append(list(seq.block_table))
    assert chunks == [[(0, 16)], [(0, 16)], [(0, 8)]]
    assert samples == [False, False, True]
    assert tables == [b(0), b(0, 1), b(0, 1, 2)]
    assert (seq.num_computed_tokens, seq.num_tokens) == (40, 41)
    # Then a decode: position 40 is in block 2, which the table already has.
    batch = step(sched)
    assert plan(batch) == [(0, 1)]
    assert seq.block_table == b(0, 1, 2)


def test_max_prefill_chunk_caps_a_chunk_and_the_rest_of_the_budget_goes_on() -> None:
    sched = make_scheduler(
        num_blocks=16, block_size=16, max_num_batched_tokens=64, max_prefill_chunk=16
    )
    a, bb = make_seq(0, 40), make_seq(1, 20)
    sched.add(a)
    sched.add(bb)
    assert plan(step(sched)) == [(0, 16), (1, 16)]
    assert (a.block_table, bb.block_table) == (b(0), b(1))
    assert plan(step(sched)) == [(0, 16), (1, 4)]
    assert (a.block_table, bb.block_table) == (b(0, 2), b(1, 3))
    # bb sampled and decodes; a finishes its prompt.
    assert plan(step(sched)) == [(0, 8), (1, 1)]
    assert (a.block_table, bb.block_table) == (b(0, 2, 4), b(1, 3))


def test_budget_is_shared_and_decodes_come_first() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=16)
    a = make_seq(0, 4)
    sched.add(a)
    assert plan(step(sched)) == [(0, 4)]
    assert a.block_table == b(0)
    bb = make_seq(1, 30)
    sched.add(bb)
    # a's decode (position 4: a new block) is served before bb's chunk takes the rest.
    batch = sched.schedule()
    assert plan(batch) == [(0, 1), (1, 15)]
    assert [s.samples for s in batch.scheduled] == [True, False]
    assert a.block_table == b(0, 1)
    assert bb.block_table == b(2, 3, 4, 5)
    simulate(batch)
    batch = sched.schedule()
    assert plan(batch) == [(0, 1), (1, 15)]
    assert [s.samples for s in batch.scheduled] == [True, True]
    simulate(batch)
    assert bb.block_table == b(2, 3, 4, 5, 6, 7, 8, 9)
    assert plan(step(sched)) == [(0, 1), (1, 1)]


def test_running_prompt_chunks_go_before_new_prompts() -> None:
    sched = make_scheduler(num_blocks=16, block_size=16, max_num_batched_tokens=16)
    a, bb = make_seq(0, 40), make_seq(1, 10)
    sched.add(a)
    sched.add(bb)
    assert plan(step(sched)) == [(0, 16)]
    assert list(sched.waiting) == [bb]
    assert plan(step(sched)) == [(0, 16)]
    assert plan(step(sched)) == [(0, 8), (1, 8)]
    assert (a.block_table, bb.block_table) == (b(0, 1, 2), b(3))
    assert plan(step(sched)) == [(0, 1), (1, 2)]


def test_budget_left_after_decodes_bounds_the_new_chunk() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    seqs = [make_seq(i, 2) for i in range(4)]
    for s in seqs:
        sched.add(s)
    assert plan(step(sched)) == [(0, 2), (1, 2), (2, 2), (3, 2)]
    late = make_seq(4, 10)
    sched.add(late)
    assert plan(step(sched)) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 4)]
    assert plan(step(sched)) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 4)]
    assert plan(step(sched)) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 2)]


def test_decodes_alone_can_fill_the_budget() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=3)
    seqs = [make_seq(i, 1) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert plan(step(sched)) == [(0, 1), (1, 1), (2, 1)]
    sched.add(make_seq(3, 1))
    assert plan(step(sched)) == [(0, 1), (1, 1), (2, 1)]
    assert [s.seq_id for s in sched.waiting] == [3]


def test_max_num_seqs_bounds_the_running_set() -> None:
    sched = make_scheduler(num_blocks=16, max_num_seqs=2)
    seqs = [make_seq(i, 2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert plan(step(sched)) == [(0, 2), (1, 2)]
    assert list(sched.waiting) == [seqs[2]]
    sched.finish(seqs[0], FinishReason.LENGTH)
    assert plan(step(sched)) == [(1, 1), (2, 2)]


def test_no_admission_when_blocks_are_short() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=32)
    a, bb, c = make_seq(0, 12), make_seq(1, 8), make_seq(2, 2)
    for s in (a, bb, c):
        sched.add(s)
    batch = step(sched)
    # bb needs 2 blocks and only 1 is free; c is behind bb (first come, first served).
    assert plan(batch) == [(0, 12)]
    assert a.block_table == b(0, 1, 2)
    assert list(sched.waiting) == [bb, c]
    assert bb.block_table == [] and c.block_table == []
    assert sched.kv.pool.free_block_ids() == b(3)
    assert sched.kv.pool.ref_counts == [1, 1, 1, 0]
    # Once a is done its blocks come back and bb and c fit.
    sched.finish(a, FinishReason.STOP)
    batch = step(sched)
    assert plan(batch) == [(1, 8), (2, 2)]
    assert bb.block_table == b(3, 2)
    assert c.block_table == b(1)


def test_preemption_takes_the_newest_and_admits_nothing() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4, max_prefill_chunk=4)
    a, bb = make_seq(0, 3), make_seq(1, 8)
    sched.add(a)
    sched.add(bb)
    assert plan(step(sched)) == [(0, 3), (1, 4)]
    assert (a.block_table, bb.block_table) == (b(0), b(1))
    assert plan(step(sched)) == [(0, 1), (1, 4)]
    assert (a.block_table, bb.block_table) == (b(0), b(1, 2))
    assert sched.kv.pool.num_free == 0
    c = make_seq(2, 1)
    sched.add(c)
    # a (older) writes position 4 and needs a block: bb, the newest, is preempted.
    batch = sched.schedule()
    assert plan(batch) == [(0, 1)]
    assert batch.preempted == [bb]
    assert a.block_table == b(0, 2)
    assert bb.block_table == []
    assert bb.num_computed_tokens == 0
    assert bb.num_tokens == 9  # the token it sampled is kept and will be recomputed
    assert bb.status is SequenceStatus.WAITING
    assert bb.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [bb, c]
    assert sched.running == [a]
    # Block 1 is free, and bb's first chunk would fit, but nothing is admitted this step.
    assert sched.kv.pool.free_block_ids() == b(1)
    simulate(batch)
    batch = step(sched)
    assert plan(batch) == [(0, 1), (1, 4)]
    assert bb.block_table == b(1)
    assert sched.running == [a, bb]


def test_preemption_victim_is_the_newest_of_several() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, bb, c = make_seq(0, 4), make_seq(1, 3), make_seq(2, 3)
    for s in (a, bb, c):
        sched.add(s)
    assert plan(step(sched)) == [(0, 4), (1, 3), (2, 3)]
    assert (a.block_table, bb.block_table, c.block_table) == (b(0), b(1), b(2))
    d = make_seq(3, 4)
    sched.add(d)
    # a's decode takes the last free block (position 4); d finds none left.
    assert plan(step(sched)) == [(0, 1), (1, 1), (2, 1)]
    assert a.block_table == b(0, 3)
    assert list(sched.waiting) == [d]
    assert sched.kv.pool.num_free == 0
    # bb and c write position 4: bb needs a block, c (newest running) is preempted for it.
    batch = sched.schedule()
    assert batch.preempted == [c]
    assert plan(batch) == [(0, 1), (1, 1)]
    assert bb.block_table == b(1, 2)
    assert list(sched.waiting) == [c, d]
    assert sched.num_preemptions == 1


def test_preempting_itself_when_it_is_the_newest() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4)
    a, bb = make_seq(0, 3), make_seq(1, 4)
    sched.add(a)
    sched.add(bb)
    assert plan(step(sched)) == [(0, 3), (1, 4)]
    # bb writes position 4 and needs a block; the newest running sequence is bb itself.
    batch = sched.schedule()
    assert plan(batch) == [(0, 1)]
    assert batch.preempted == [bb]
    assert sched.running == [a]
    assert list(sched.waiting) == [bb]
    assert sched.kv.pool.free_block_ids() == b(1)


def test_copy_on_write_of_a_shared_partial_block() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    parent = make_seq(0, 6)
    sched.add(parent)
    batch = sched.schedule()
    assert plan(batch) == [(0, 6)]
    parent.num_computed_tokens += 6
    # Fork before the parent's token is appended (as the Engine does), then each appends its own.
    child = fork(sched, parent, 1)
    parent.token_ids.append(11)
    child.token_ids.append(12)
    assert parent.block_table == child.block_table == b(0, 1)
    assert sched.kv.pool.ref_counts[:2] == [2, 2]
    batch = sched.schedule()
    assert plan(batch) == [(0, 1), (1, 1)]
    # The parent writes position 6 into shared block 1: it gets a private copy (block 2).
    # The child is then the only holder of block 1 and writes it in place.
    assert batch.block_copies == [(BlockId(1), BlockId(2))]
    assert parent.block_table == b(0, 2)
    assert child.block_table == b(0, 1)
    assert sched.kv.pool.ref_counts[:3] == [2, 1, 1]
    simulate(batch)
    # The shared full block 0 is never written again: no more copies.
    batch = sched.schedule()
    assert batch.block_copies == []
    assert plan(batch) == [(0, 1), (1, 1)]


def test_copy_on_write_with_three_holders() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    parent = make_seq(0, 5)
    sched.add(parent)
    simulate(sched.schedule())
    parent.token_ids.pop()  # fork from the prompt, as the Engine does
    kids = [fork(sched, parent, 1), fork(sched, parent, 2)]
    for s in (parent, *kids):
        s.token_ids.append(NEXT_TOKEN)
    assert sched.kv.pool.ref_counts[:2] == [3, 3]
    batch = sched.schedule()
    assert batch.block_copies == [(BlockId(1), BlockId(2)), (BlockId(1), BlockId(3))]
    assert [s.block_table for s in (parent, *kids)] == [b(0, 2), b(0, 3), b(0, 1)]
    assert sched.kv.pool.ref_counts[:4] == [3, 1, 1, 1]


def test_no_copy_when_the_shared_block_is_full() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    parent = make_seq(0, 8)
    sched.add(parent)
    simulate(sched.schedule())
    parent.token_ids.pop()
    child = fork(sched, parent, 1)
    parent.token_ids.append(NEXT_TOKEN)
    child.token_ids.append(NEXT_TOKEN)
    batch = sched.schedule()
    assert batch.block_copies == []
    assert parent.block_table == b(0, 1, 2)
    assert child.block_table == b(0, 1, 3)
    assert sched.kv.pool.ref_counts[:4] == [2, 2, 1, 1]


def test_finish_frees_blocks_at_once() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4)
    a, bb = make_seq(0, 9), make_seq(1, 2)
    sched.add(a)
    sched.add(bb)
    step(sched)
    assert (a.block_table, bb.block_table) == (b(0, 1, 2), b(3))
    sched.finish(a, FinishReason.STOP)
    assert a.status is SequenceStatus.FINISHED
    assert a.finish_reason is FinishReason.STOP
    assert a.block_table == []
    assert sched.running == [bb]
    assert sched.kv.pool.free_block_ids() == b(4, 5, 2, 1, 0)
    sched.kv.pool.check()


def test_finish_a_waiting_sequence() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4)
    a, bb, c = make_seq(0, 8), make_seq(1, 4), make_seq(2, 4)
    for s in (a, bb, c):
        sched.add(s)
    step(sched)
    assert list(sched.waiting) == [bb, c]
    sched.finish(bb, FinishReason.ABORT)
    assert list(sched.waiting) == [c]
    assert bb.finish_reason is FinishReason.ABORT
    assert sched.kv.pool.num_free == 0
    sched.finish(a, FinishReason.ABORT)
    assert sched.kv.pool.free_block_ids() == b(1, 0)
    assert plan(step(sched)) == [(2, 4)]
    assert sched.running == [c]


@settings(max_examples=60, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 6), st.integers(0, 3)),
        min_size=1,
        max_size=8,
    ),
    num_blocks=st.integers(9, 14),
    budget=st.integers(4, 24),
    chunk=st.integers(1, 16),
)
def test_random_workload_runs_to_completion_without_leaks(
    jobs: list[tuple[int, int, int]], num_blocks: int, budget: int, chunk: int
) -> None:
    """(prompt length, max_tokens, arrival step) jobs; every sequence fits the pool alone."""
    bs = 4
    sched = make_scheduler(num_blocks, bs, budget, chunk)
    seqs = [make_seq(i, p, m) for i, (p, m, _) in enumerate(jobs)]
    done: list[Sequence] = []
    for t in range(2000):
        for seq, (_, _, arrive) in zip(seqs, jobs, strict=True):
            if arrive == t:
                sched.add(seq)
        batch = sched.schedule()
        assert batch.num_tokens <= budget
        assert all(0 < s.num_new_tokens <= chunk for s in batch.scheduled)
        assert len({s.seq.seq_id for s in batch.scheduled}) == len(batch.scheduled)
        for s in batch.scheduled:
            end = s.seq.num_computed_tokens + s.num_new_tokens
            assert len(s.seq.block_table) * bs >= end
        refs = Counter(blk for s in sched.running for blk in s.block_table)
        assert all(sched.kv.pool.ref_counts[k] == refs[BlockId(k)] for k in range(num_blocks))
        sched.kv.pool.check()
        for seq in simulate(batch):
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
                done.append(seq)
        if t > max(j[2] for j in jobs) and not sched.has_work():
            break
    assert sorted(s.seq_id for s in done) == list(range(len(jobs)))
    assert all(s.num_output_tokens == s.params.max_tokens for s in done)
    assert sched.kv.pool.num_free == num_blocks
    sched.kv.pool.check()


# ---- speculative decoding: drafts ------------------------------------------------------------


class FixedDrafter:
    """Proposes the same drafts to every sequence, as many as the scheduler's limit allows."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        return self.drafts[:limit]


def drafted(batch: Batch) -> list[tuple[int, int, int]]:
    """(seq_id, num_new_tokens, num_drafts) in scheduled order."""
    return [(s.seq.seq_id, s.num_new_tokens, s.num_drafts) for s in batch.scheduled]


def test_drafts_extend_decodes_oldest_first_within_the_budget() -> None:
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    sched.drafter = FixedDrafter([1, 2, 3, 4])
    a, b = make_seq(0, 3), make_seq(1, 3)
    sched.add(a)
    sched.add(b)
    assert drafted(step(sched)) == [(0, 3, 0), (1, 3, 0)]  # prompts draft nothing
    batch = sched.schedule()
    # a plain token each first (6 left), then a's 4 drafts, then b's 2 (the budget's end)
    assert drafted(batch) == [(0, 5, 4), (1, 3, 2)]
    assert a.draft_tokens == [1, 2, 3, 4] and b.draft_tokens == [1, 2]
    assert all(s.samples for s in batch.scheduled) and batch.num_tokens == 8
    assert [len(a.block_table), len(b.block_table)] == [2, 2]  # slots up to position 7 / 5
    sched.advance(batch, 0.0)
    # the drafts' K/V counts only once their verification accepts them
    assert (a.num_computed_tokens, b.num_computed_tokens) == (4, 4)


def test_a_draft_never_takes_a_block_another_needs() -> None:
    sched = make_scheduler(num_blocks=2)
    sched.drafter = FixedDrafter([1, 2, 3])
    a, b = make_seq(0, 3), make_seq(1, 3)
    sched.add(a)
    sched.add(b)
    step(sched)
    batch = sched.schedule()  # each writes position 3 in its own block; drafts need a new one
    assert drafted(batch) == [(0, 1, 0), (1, 1, 0)] and not batch.preempted
    assert a.draft_tokens == [] and b.draft_tokens == []


def test_a_step_that_preempts_drafts_nothing_and_preemption_drops_drafts() -> None:
    sched = make_scheduler(num_blocks=3)
    sched.drafter = FixedDrafter([1, 2])
    a, b = make_seq(0, 4), make_seq(1, 4)
    sched.add(a)
    sched.add(b)
    step(sched)
    batch = sched.schedule()  # position 4 needs a second block each: one is free
    assert drafted(batch) == [(0, 1, 0)] and batch.preempted == [b]
    a.draft_tokens = [6]
    sched.requeue(a)
    assert a.draft_tokens == [] and a.status is SequenceStatus.WAITING
