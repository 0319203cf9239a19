"""The KVCacheManager on its own: a small real cache, hand-made Sequences, no model. Exact block
ids (the pool hands out its free list front first), copy-on-write copies, what enters and
leaves each tier (the tier events), and that a block copied in from the host tier holds the
K/V that was evicted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kvserve.shared.config import StoreConfig
from kvserve.shared.engine.kv.cache import KVCache
from kvserve.shared.engine.kv.manager import KVCacheManager, KVIdentity
from kvserve.shared.engine.sequence import BlockId, Sequence
from kvserve.shared.store.codec import BlockMeta

from tests.shared.engine.helpers import prompt_sequence
from tests.shared.model_configs import model_config

BS = 4
MODEL = model_config(num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=64)
IDENTITY = KVIdentity(BlockMeta("test-model", "float32", BS, 2, 1, 4), "test-tok")


def manager(num_blocks: int, store: str | None = None, caching: bool = True) -> KVCacheManager:
    cache = KVCache(MODEL, num_blocks, BS, torch.float32)
    config = StoreConfig(url=store) if store else None
    return KVCacheManager(cache, IDENTITY, enable_caching=caching, store=config)


@pytest.fixture
def kv_host() -> Iterator[KVCacheManager]:
    """Four blocks, a host tier and an in-memory store behind them."""
    kv = manager(4, store="memory://")
    yield kv
    kv.close()


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return prompt_sequence(seq_id, tokens, root_hash=IDENTITY.root_hash())


def compute(kv: KVCacheManager, seq: Sequence) -> None:
    """What a step does for the whole prompt: blocks, K/V written (a value per block), the
    full blocks published."""
    assert kv.allocate_slots(seq, seq.num_tokens) == []
    for layer in range(MODEL.num_layers):
        for i, b in enumerate(seq.block_table):
            kv.cache.k[layer][b] = float(10 * seq.token_ids[i * BS] + layer)
    seq.num_computed_tokens = seq.num_tokens
    kv.publish(seq)


def events(kv: KVCacheManager) -> dict[str, int]:
    return {f"{t}_{k}": n for (t, k), n in kv.events.counts.items()}


def test_slots_come_from_the_front_of_the_free_list() -> None:
    kv = manager(8, caching=False)
    a = seq_of(0, list(range(9)))  # 9 tokens: 3 blocks
    assert kv.allocate_slots(a, 9) == []
    assert a.block_table == [0, 1, 2]
    b = seq_of(1, list(range(3)))
    assert kv.allocate_slots(b, 3) == []
    assert b.block_table == [3]
    assert kv.allocate_slots(seq_of(2, list(range(20))), 20) is None  # 5 blocks, 4 free
    kv.free(a)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 2, 1, 0]  # tail first
    assert a.block_table == []


def test_a_write_into_a_shared_block_copies_it_first() -> None:
    kv = manager(8, caching=False)
    parent = seq_of(0, list(range(6)))
    assert kv.allocate_slots(parent, 6) == []
    parent.num_computed_tokens = 6
    child = seq_of(1, parent.token_ids)
    kv.fork(parent, child)
    assert child.block_table == [0, 1] and kv.pool.ref_counts[:2] == [2, 2]
    child.token_ids.append(99)
    # The child writes token 6 into block 1, which the parent shares: a private copy first.
    assert kv.allocate_slots(child, 1) == [(BlockId(1), BlockId(2))]
    assert child.block_table == [0, 2] and kv.pool.ref_counts[:3] == [2, 1, 1]


def test_published_blocks_match_later_and_count_as_stored() -> None:
    kv = manager(8)
    a = seq_of(0, list(range(10)))  # 2 full blocks and a partial one
    compute(kv, a)
    assert events(kv) == {"device_stored": 2}
    assert kv.tiers.num_cached_blocks == 2
    kv.free(a)
    b = seq_of(1, list(range(10)))
    kv.match_prefix(b)
    assert b.block_table == [0, 1] and b.num_computed_tokens == 8
    assert b.cached_tokens_by_source == {"device": 8}
    assert kv.local_prefix(b.full_block_hashes(2, BS)) == (2, 0)


def test_an_evicted_block_goes_to_the_host_tier_and_comes_back_intact(
    kv_host: KVCacheManager,
) -> None:
    kv = kv_host
    a = seq_of(0, [5] * 4 + [6] * 4 + [7])
    compute(kv, a)
    kv.free(a)
    expected = [kv.cache.k[layer][0].clone() for layer in range(MODEL.num_layers)]
    hashes = a.full_block_hashes(2, BS)
    assert kv.local_prefix(hashes) == (2, 0)
    # Four new blocks: the two free ones, then both cached blocks are evicted to the host.
    other = seq_of(1, list(range(100, 116)))
    assert kv.allocate_slots(other, 16) == []
    assert kv.local_prefix(hashes) == (0, 2)
    assert events(kv) == {
        "device_stored": 2,
        "store_stored": 2,
        "device_removed": 2,
        "host_stored": 2,
    }
    kv.free(other)
    b = seq_of(2, a.token_ids)
    kv.match_prefix(b)
    assert b.cached_tokens_by_source == {"device": 0, "host": 8}
    assert b.num_computed_tokens == 8 and len(b.block_table) == 2
    for layer in range(MODEL.num_layers):
        assert torch.equal(kv.cache.k[layer][b.block_table[0]], expected[layer])
    assert events(kv)["device_stored"] == 4  # cached again on the device


def test_reset_drops_the_device_cache_and_the_host_tier(kv_host: KVCacheManager) -> None:
    kv = kv_host
    a = seq_of(0, list(range(9)))
    compute(kv, a)
    kv.free(a)
    assert kv.allocate_slots(seq_of(1, list(range(50, 62))), 12) == []  # evicts one of two
    assert (kv.tiers.num_cached_blocks, kv.tiers.num_host_blocks) == (1, 1)
    assert kv.reset() == {"device_blocks": 1, "host_blocks": 1}
    assert (kv.tiers.num_cached_blocks, kv.tiers.num_host_blocks) == (0, 0)
    assert events(kv)["device_removed"] == 2 and events(kv)["host_removed"] == 1


def test_the_last_prompt_token_is_never_matched() -> None:
    kv = manager(8)
    a = seq_of(0, list(range(8)))  # exactly two blocks
    compute(kv, a)
    kv.free(a)
    b = seq_of(1, list(range(8)))
    kv.match_prefix(b)
    assert b.num_computed_tokens == 4 and b.block_table == [0]  # token 7 is computed


def test_store_load_cost_is_the_fetch_rules_ratio(kv_host: KVCacheManager) -> None:
    """The ratio a worker reports for the router: a store load's estimate over recomputing a
    block, at most 1; None without a store."""
    assert manager(4).store_load_cost() is None
    assert kv_host.connector is not None
    assert kv_host.store_load_cost() is None  # nothing measured yet: only guesses
    kv_host.observe_prefill(prompt_tokens=100, step_tokens=100, seconds=0.1)
    assert kv_host.store_load_cost() is None  # no load measured yet
    kv_host.connector.counters["fetched_blocks"] += 1
    kv_host.prefill_s_per_token = 0.001  # a block of 4 tokens: 4 ms to recompute
    kv_host.connector.fetch_s_per_block = 0.001
    assert kv_host.store_load_cost() == pytest.approx(0.25)
    kv_host.connector.fetch_s_per_block = 0.010  # slower than recomputing: worth nothing
    assert kv_host.store_load_cost() == 1.0
