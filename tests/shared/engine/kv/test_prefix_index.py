"""PrefixIndex: exact eviction order, and agreement with a plain dict model (hypothesis)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvserve.shared.engine.kv.prefix_index import PrefixIndex
from kvserve.shared.engine.sequence import BlockId
from kvserve.shared.store.hashing import BlockHash, block_hashes, root_hash

ROOT = root_hash("model", "tok", "float32", 2)


def hashes(tokens: list[int]) -> list[BlockHash]:
    return block_hashes(ROOT, tokens, 2)


def insert_chain(index: PrefixIndex, hs: list[BlockHash], first_block: int) -> list[BlockId]:
    blocks = []
    for i, h in enumerate(hs):
        b = BlockId(first_block + i)
        assert index.insert(blocks[-1] if blocks else None, h, b)
        blocks.append(b)
    return blocks


def test_match_longest_prefix() -> None:
    index = PrefixIndex()
    a = hashes([1, 2, 3, 4, 5, 6])
    insert_chain(index, a, 0)
    assert index.match(a) == [0, 1, 2]
    assert index.match(hashes([1, 2, 3, 4, 9, 9])) == [0, 1]
    assert index.match(hashes([7, 7, 3, 4])) == []
    assert not index.insert(None, a[0], BlockId(9))  # already cached
    assert not index.insert(BlockId(7), hashes([8, 8, 8, 8])[1], BlockId(9))  # parent uncached


def test_shared_system_prompt_outlives_unique_suffixes() -> None:
    index = PrefixIndex()
    system = [1, 1, 2, 2]  # two blocks shared by every request
    reqs = [[*system, 10 + i, 10 + i, 20 + i, 20 + i] for i in range(3)]
    chains = [hashes(r) for r in reqs]
    insert_chain(index, chains[0], 0)  # blocks 0,1 (system), 2,3 (suffix 0)
    for i in (1, 2):
        assert index.match(chains[i]) == [0, 1]
        for j in (2, 3):
            parent = BlockId(1) if j == 2 else BlockId(2 * i + 2)
            assert index.insert(parent, chains[i][j], BlockId(2 * i + j))
    # Request 0's suffix released first, then 1's, then 2's, then the system prompt's blocks.
    for b in [3, 2, 5, 4, 7, 6, 1, 0]:
        index.release(BlockId(b))
    # Leaves first, least recently released first; the system prompt goes last.
    assert index.eviction_order() == [3, 2, 5, 4, 7, 6, 1, 0]
    assert index.evict(3) == [(3, chains[0][3]), (2, chains[0][2]), (5, chains[1][3])]
    assert index.match(chains[0]) == [0, 1]  # prefix still there
    assert index.match(chains[1]) == [0, 1, 4]  # its tail block 5 is gone, block 4 is left
    assert len(index) == 5


def test_touched_prefix_evicted_later() -> None:
    index = PrefixIndex()
    a, b = hashes([1, 1, 2, 2]), hashes([3, 3, 4, 4])
    insert_chain(index, a, 0)
    insert_chain(index, b, 2)
    for blk in (1, 0, 3, 2):
        index.release(BlockId(blk))
    index.acquire(BlockId(0))
    index.acquire(BlockId(1))
    index.match(a)
    index.release(BlockId(1))
    index.release(BlockId(0))
    assert index.eviction_order() == [3, 2, 1, 0]


def test_a_lookup_does_not_hide_a_leaf_from_eviction() -> None:
    """A match that takes no reference (a lookup: how much is cached locally) touches the
    blocks; they stay evictable and `evict(num_evictable)` still finds every one."""
    index = PrefixIndex()
    a = hashes([1, 1, 2, 2])
    insert_chain(index, a, 0)
    for blk in (1, 0):
        index.release(BlockId(blk))
    assert index.match(a) == [0, 1]
    assert index.num_evictable == 2
    assert [b for b, _ in index.evict(2)] == [1, 0]


class IndexModel(RuleBasedStateMachine):
    """The index against a dict {hash chain prefix: block}, with explicit evictability.

    Like the engine, a holder references whole chains: a block is released only when none of
    its cached children is still held."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.model: dict[tuple[BlockHash, ...], BlockId] = {}
        self.evictable: set[BlockId] = set()
        self.next_block = 0

    tokens = st.lists(st.integers(0, 2), min_size=2, max_size=10)

    @rule(tokens=tokens)
    def insert(self, tokens: list[int]) -> None:
        hs = hashes(tokens)
        for i, h in enumerate(hs):
            key = tuple(hs[: i + 1])
            parent = self.model.get(tuple(hs[:i])) if i else None
            if i and parent is None:
                break
            b = BlockId(self.next_block)
            ok = self.index.insert(parent, h, b)
            assert ok == (key not in self.model)
            if ok:
                self.model[key] = b
                self.next_block += 1
            elif self.model[key] in self.evictable:  # the engine would hit it, not insert
                break

    def expected_match(self, hs: list[BlockHash]) -> list[BlockId]:
        """The model's answer to a match: the blocks of the longest cached prefix of `hs`."""
        expected = []
        for i in range(len(hs)):
            key = tuple(hs[: i + 1])
            if key not in self.model:
                break
            expected.append(self.model[key])
        return expected

    @rule(tokens=tokens)
    def match(self, tokens: list[int]) -> None:
        hs = hashes(tokens)
        expected = self.expected_match(hs)
        assert self.index.match(hs) == expected
        for b in expected:  # the caller takes a reference on each hit
            self.index.acquire(b)
            self.evictable.discard(b)

    @rule(tokens=tokens)
    def look(self, tokens: list[int]) -> None:
        """A match that takes no reference (a lookup)."""
        hs = hashes(tokens)
        assert self.index.match(hs) == self.expected_match(hs)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        def has_held_child(key: tuple[BlockHash, ...]) -> bool:
            return any(
                len(k) == len(key) + 1 and k[:-1] == key and v not in self.evictable
                for k, v in self.model.items()
            )

        held = sorted(
            v for k, v in self.model.items() if v not in self.evictable and not has_held_child(k)
        )
        if held:
            b = data.draw(st.sampled_from(held))
            self.index.release(b)
            self.evictable.add(b)

    @precondition(lambda self: self.index.num_evictable > 0)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(1, self.index.num_evictable))
        for b, h in self.index.evict(n):
            assert b in self.evictable
            key = next(k for k, v in self.model.items() if v == b)
            assert key[-1] == h
            children = [k for k in self.model if len(k) == len(key) + 1 and k[:-1] == key]
            assert not children, "evicted a block that still had cached children"
            del self.model[key]
            self.evictable.discard(b)

    @invariant()
    def sizes_agree(self) -> None:
        assert len(self.index) == len(self.model)
        assert self.index.num_evictable == len(self.evictable)


TestIndexModel = IndexModel.TestCase
TestIndexModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
