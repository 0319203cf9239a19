"""BlockPool: exact block ids, LRU order of the free list, reference counts.

The state machine models the pool as holders (a sequence's table) -> blocks plus the expected
free list, and checks after every rule that the pool agrees with the model exactly.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvserve.shared.engine.kv.block_pool import BlockPool
from kvserve.shared.engine.sequence import BlockId


def ids(*xs: int) -> list[BlockId]:
    return [BlockId(x) for x in xs]


def test_fresh_pool_is_all_free_in_id_order() -> None:
    pool = BlockPool(5)
    assert pool.free_block_ids() == ids(0, 1, 2, 3, 4)
    assert (pool.num_free, pool.num_used, pool.usage) == (5, 0, 0.0)
    assert pool.ref_counts == [0, 0, 0, 0, 0]
    pool.check()


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_takes_from_the_front() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == ids(0, 1)
    assert pool.allocate(3) == ids(2, 3, 4)
    assert pool.allocate(0) == []
    assert pool.free_block_ids() == ids(5)
    assert pool.ref_counts == [1, 1, 1, 1, 1, 0]
    assert (pool.num_free, pool.num_used, pool.usage) == (1, 5, 5 / 6)
    pool.check()


def test_free_appends_to_the_back() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert (a, b) == (ids(0, 1), ids(2, 3))
    pool.free(b)
    assert pool.free_block_ids() == ids(4, 5, 2, 3)
    pool.free(a)
    assert pool.free_block_ids() == ids(4, 5, 2, 3, 0, 1)
    # The block released longest ago is reused first.
    assert pool.allocate(3) == ids(4, 5, 2)
    assert pool.free_block_ids() == ids(3, 0, 1)
    pool.check()


def test_free_reversed_table_puts_the_tail_first() -> None:
    pool = BlockPool(5)
    table = pool.allocate(3)
    assert table == ids(0, 1, 2)
    pool.free(reversed(table))
    assert pool.free_block_ids() == ids(3, 4, 2, 1, 0)
    assert pool.allocate(5) == ids(3, 4, 2, 1, 0)
    assert pool.num_free == 0
    pool.check()


def test_allocate_too_many_returns_none_and_changes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.allocate(1)
    pool.free(held)  # free list: 1, 2, 3, 0
    pool.allocate(1)  # takes 1
    before_free, before_rc = pool.free_block_ids(), list(pool.ref_counts)
    assert pool.allocate(4) is None
    assert pool.free_block_ids() == before_free == ids(2, 3, 0)
    assert pool.ref_counts == before_rc == [0, 1, 0, 0]
    assert pool.allocate(3) == ids(2, 3, 0)
    assert pool.allocate(1) is None
    pool.check()


def test_double_free_raises() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    assert pool.free_block_ids() == ids(1, 2, 0)
    assert pool.ref_counts == [0, 0, 0]
    pool.check()


def test_free_of_never_allocated_block_raises() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.free(ids(2))
    assert pool.free_block_ids() == ids(0, 1, 2)
    pool.check()


def test_sharing_a_free_block_raises() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="free"):
        pool.share(ids(1))
    assert pool.free_block_ids() == ids(0, 1, 2)
    assert pool.ref_counts == [0, 0, 0]
    pool.check()


def test_shared_block_is_freed_by_its_last_holder() -> None:
    pool = BlockPool(4)
    table = pool.allocate(2)
    assert table == ids(0, 1)
    pool.share(table)
    assert pool.ref_counts == [2, 2, 0, 0]
    assert pool.is_shared(BlockId(0)) and pool.is_shared(BlockId(1))
    assert not pool.is_shared(BlockId(2))
    pool.free(reversed(table))
    assert pool.ref_counts == [1, 1, 0, 0]
    assert pool.free_block_ids() == ids(2, 3)
    assert not pool.is_shared(BlockId(0))
    pool.free(reversed(table))
    assert pool.ref_counts == [0, 0, 0, 0]
    assert pool.free_block_ids() == ids(2, 3, 1, 0)
    pool.check()


def test_check_catches_a_corrupted_pool() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool.ref_counts[0] = 0  # used block with no reference: the free list disagrees
    with pytest.raises(AssertionError):
        pool.check()


NUM_BLOCKS = 12


class BlockPoolMachine(RuleBasedStateMachine):
    """Model: holders -> their blocks (a table) and the expected free list in LRU order."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.holders: dict[int, list[BlockId]] = {}
        self.free_model: list[BlockId] = [BlockId(b) for b in range(NUM_BLOCKS)]
        self.next_holder = 0

    def _add_holder(self, blocks: list[BlockId]) -> None:
        self.holders[self.next_holder] = blocks
        self.next_holder += 1

    def _holder_refs(self) -> Counter[BlockId]:
        return Counter(b for blocks in self.holders.values() for b in blocks)

    @rule(n=st.integers(min_value=0, max_value=NUM_BLOCKS + 2))
    def allocate(self, n: int) -> None:
        got = self.pool.allocate(n)
        if n > len(self.free_model):
            assert got is None
            return
        assert got == self.free_model[:n]
        del self.free_model[:n]
        self._add_holder(list(got))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        """A new holder shares some of an existing holder's blocks (a common prefix)."""
        h = data.draw(st.sampled_from(sorted(self.holders)))
        blocks = self.holders[h]
        k = data.draw(st.integers(min_value=0, max_value=len(blocks)))
        self.pool.share(blocks[:k])
        self._add_holder(blocks[:k])

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """A new holder shares a holder's whole table (an n > 1 sibling)."""
        h = data.draw(st.sampled_from(sorted(self.holders)))
        table = list(self.holders[h])
        self.pool.share(table)
        self._add_holder(table)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free_holder(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.holders)))
        table = self.holders.pop(h)
        self.pool.free(reversed(table))
        refs = self._holder_refs()
        self.free_model.extend(b for b in reversed(table) if refs[b] == 0)

    @precondition(lambda self: self.free_model)
    @rule(data=st.data())
    def share_free_block_raises(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.free_model))
        with pytest.raises(ValueError):
            self.pool.share([b])

    @precondition(lambda self: self.free_model)
    @rule(data=st.data())
    def double_free_raises(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.free_model))
        with pytest.raises(ValueError):
            self.pool.free([b])

    @invariant()
    def free_list_matches_model(self) -> None:
        assert self.pool.free_block_ids() == self.free_model

    @invariant()
    def free_plus_used_is_total(self) -> None:
        assert self.pool.num_free + self.pool.num_used == NUM_BLOCKS
        assert self.pool.num_free == len(self.free_model)

    @invariant()
    def reference_counts_match_holders(self) -> None:
        refs = self._holder_refs()
        for b in range(NUM_BLOCKS):
            rc = self.pool.ref_counts[b]
            assert rc >= 0
            assert rc == refs[BlockId(b)]

    @invariant()
    def no_block_both_free_and_held(self) -> None:
        refs = self._holder_refs()
        for b in self.pool.free_block_ids():
            assert self.pool.ref_counts[b] == 0
            assert refs[b] == 0

    @invariant()
    def pool_check_passes(self) -> None:
        self.pool.check()


BlockPoolMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
TestBlockPoolMachine = BlockPoolMachine.TestCase
