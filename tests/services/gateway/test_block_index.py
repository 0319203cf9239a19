"""The router's block indexes: `leading_runs` over BlockHolders gives each worker the run a walk
of its own index would, and the holders' masks stay in step with every WorkerIndex through
stores, removals, LRU evictions, "cleared", gaps and a worker's departure."""

from __future__ import annotations

import random

from kvserve.services.gateway.block_index import (
    BlockHolders,
    WorkerIndex,
    leading,
    leading_runs,
    runs_from,
)
from kvserve.services.gateway.router import Router
from kvserve.shared.protocol import KVEvent, WorkerInfo


def info(name: str, incarnation: str = "i") -> WorkerInfo:
    return WorkerInfo(name, "worker", incarnation, 16, "m", "t", "float32", "", 0.0)


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def event(worker: str, seq: int, op: str, hashes: list[int], tier: str = "device") -> KVEvent:
    return KVEvent(worker, "i", seq, op, tier, [h(x) for x in hashes])


def masks_of(indexes: dict[str, WorkerIndex]) -> dict[bytes, int]:
    """The masks the holders must have: each worker's bit on each hash its index holds."""
    out: dict[bytes, int] = {}
    for index in indexes.values():
        for block in index._tiers:
            out[block] = out.get(block, 0) | index.bit
    return out


def test_leading_runs_equal_a_walk_per_worker() -> None:
    rng = random.Random(0)
    held, pending = BlockHolders(), BlockHolders()
    sets: dict[str, set[bytes]] = {f"w{k}": set() for k in range(9)}
    slots = {name: 1 << k for k, name in enumerate(sets)}
    prompt = [h(i) for i in range(40)]
    for name, blocks in sets.items():
        run = rng.randrange(0, 41)
        extra = {h(rng.randrange(0, 60)) for _ in range(10)}
        blocks |= set(prompt[:run]) | extra
        for b in blocks:
            (held if rng.random() < 0.7 else pending).add(b, slots[name])
    runs = leading_runs(prompt, slots, held, pending)
    assert runs == {name: leading(prompt, blocks.__contains__) for name, blocks in sets.items()}
    assert leading_runs(prompt, slots) == dict.fromkeys(slots, 0)
    assert leading_runs([], slots, held) == dict.fromkeys(slots, 0)


def test_runs_from_gives_the_present_run_at_every_start() -> None:
    present = {h(1), h(2), h(4)}
    hashes = [h(i) for i in range(6)]
    ends = runs_from(hashes, present.__contains__)
    assert [ends[i] - i for i in range(7)] == [0, 2, 1, 0, 1, 0, 0]


def test_holders_follow_stores_removals_evictions_clears_and_gaps() -> None:
    holders = BlockHolders()
    a = WorkerIndex(info("a"), max_blocks=4, holders=holders, bit=1)
    b = WorkerIndex(info("b"), max_blocks=100, holders=holders, bit=2)
    indexes = {"a": a, "b": b}
    steps = [
        (a, event("a", 0, "stored", [1, 2, 3])),
        (b, event("b", 0, "stored", [2, 3, 9])),
        (a, event("a", 1, "stored", [2], tier="host")),  # a second tier: still one holder bit
        (a, event("a", 2, "removed", [2])),  # device copy gone, host copy stays
        (a, event("a", 3, "stored", [5, 6, 7])),  # past 4 blocks: LRU eviction of 1 and 3
        (b, event("b", 1, "removed", [3, 99])),
        (b, event("b", 2, "cleared", [])),
        (a, event("a", 6, "stored", [8])),  # a gap: a forgets everything first
    ]
    for index, ev in steps:
        index.apply(ev)
        assert holders.masks == masks_of(indexes)
    assert len(a) == 1 and len(b) == 0 and holders.masks == {h(8): 1}


def test_a_router_clears_a_departed_or_restarted_workers_bits() -> None:
    router = Router()
    router.set_workers({"a": info("a"), "b": info("b")}, {})
    router.apply([event("a", 0, "stored", [1, 2]), event("b", 0, "stored", [2, 3])])
    decision = router.route(list(range(64)), None)
    assert decision is not None
    router.set_workers({"b": info("b")}, {})  # a left: its blocks and pending hashes too
    a_bit_free = all(
        not mask & ~2 for mask in {**router._held.masks, **router._pending.masks}.values()
    )
    assert a_bit_free
    router.set_workers({"b": info("b", "restarted")}, {})
    assert router._held.masks == {} and router._pending.masks == {}
