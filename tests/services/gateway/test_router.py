"""The gateway's KV-cache-aware router on hand-built workers and events (block_size 4): exact
routing choices, predicted cached tokens, event sequencing, restarts and the LRU bounds; the
random and session (sticky by user) policies."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kvserve.services.gateway.block_index import WorkerIndex
from kvserve.services.gateway.router import Decision, Router
from kvserve.shared.protocol import KVEvent, WorkerInfo
from kvserve.shared.store.hashing import block_hashes, root_hash

BS = 4
PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks are considered (the last token computes)


def info(name: str, inc: str = "i1", role: str = "worker", store_id: str = "") -> WorkerInfo:
    return WorkerInfo(name, role, inc, BS, "m", "t", "fp32", store_id=store_id)


def hashes(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """Chain hashes of every full block of `tokens`."""
    return list(block_hashes(root_hash("m", "t", "fp32", BS, salt), tokens, BS))


def stored(
    worker: str, seq: int, hs: list[bytes], tier: str = "device", inc: str = "i1"
) -> KVEvent:
    return KVEvent(worker, inc, seq, "stored", tier, list(hs))


def make_router(*infos: WorkerInfo, stats: dict[str, Any] | None = None, **kw: Any) -> Router:
    router = Router(**kw)
    router.set_workers({i.name: i for i in infos}, stats or {})
    return router


def route(
    router: Router, prompt: list[int], salt: str | None = None, user: str | None = None
) -> Decision:
    decision = router.route(prompt, salt, user=user)
    assert decision is not None
    return decision


def summary(d: Decision) -> tuple[str, str, int]:
    return d.worker, d.reason, d.predicted_cached_tokens


def worker_stats(router: Router, name: str) -> dict[str, Any]:
    stats: dict[str, Any] = router.stats()["workers"][name]
    return stats


def test_cache_aware_follows_the_prefix_across_turns() -> None:
    router = make_router(info("A"), info("B"))
    router.apply([stored("A", 0, hashes(PROMPT[:12]))])
    first = route(router, PROMPT)
    assert summary(first) == ("A", "cache", 12)
    assert first.prompt_blocks == 3 and first.hashes == tuple(hashes(PROMPT[:12]))
    assert first.load_blocks == 13 // BS + 1
    router.finished(first)
    second_turn = [*PROMPT, *range(100, 112)]  # 25 tokens, 6 blocks considered
    second = route(router, second_turn)
    assert (second.worker, second.predicted_cached_tokens, second.prompt_blocks) == ("A", 12, 6)


def test_routes_on_the_whole_prompt_not_the_first_block() -> None:
    router = make_router(info("A"), info("B"))
    prefix = hashes(PROMPT[:12])
    router.apply([stored("A", 0, prefix[:1]), stored("B", 0, prefix)])
    decision = route(router, PROMPT)
    assert summary(decision) == ("B", "cache", 12)


def test_another_cache_salt_has_no_overlap() -> None:
    router = make_router(info("A"), info("B"))
    router.apply([stored("A", 0, hashes(PROMPT[:12]))])
    decision = route(router, PROMPT, salt="tenant-b")
    assert (decision.reason, decision.predicted_cached_tokens) == ("balance", 0)
    assert decision.hashes == tuple(hashes(PROMPT[:12], "tenant-b"))


def test_pending_requests_attract_their_twin_and_finish_to_zero() -> None:
    router = make_router(info("A"), info("B"), overlap_weight=2.0)
    first = route(router, PROMPT)
    second = route(router, PROMPT)
    assert second.worker == first.worker
    assert (first.predicted_cached_tokens, second.predicted_cached_tokens) == (0, 12)
    assert worker_stats(router, first.worker)["in_flight"] == 2
    router.finished(first)
    router.finished(second)
    router.finished(second)  # a repeated finish never goes negative
    after = worker_stats(router, first.worker)
    assert (after["in_flight"], after["in_flight_blocks"]) == (0, 0)
    assert route(router, PROMPT).predicted_cached_tokens == 0  # pending is gone


def test_a_computed_prompt_stays_with_its_worker_before_its_events_arrive() -> None:
    """Back to back, one after the other: the second request of a prefix follows the first to
    its worker although no KV event has arrived; a request whose prompt was not computed (it
    failed, or its usage is unknown) leaves nothing behind."""
    router = make_router(info("A"), info("B"))
    first = route(router, PROMPT)
    router.finished(first, computed=True)
    second = route(router, PROMPT)
    assert summary(second) == (first.worker, "cache", 12)
    router.finished(second)
    other = [*range(50, 63)]
    failed = route(router, other)
    router.finished(failed)  # not computed
    assert route(router, other).predicted_cached_tokens == 0
    # The worker's own events still rule: a removal takes the block out again.
    router.apply([KVEvent(first.worker, "i1", 0, "removed", "device", list(first.hashes))])
    assert route(router, PROMPT).predicted_cached_tokens == 0


def test_load_outweighs_overlap() -> None:
    router = make_router(info("A"), info("B"), stats={"A": {"num_used_blocks": 1000}, "B": {}})
    router.apply([stored("A", 0, hashes(PROMPT[:12]))])
    decision = route(router, PROMPT)
    assert summary(decision) == ("B", "balance", 0)


def test_a_load_report_older_than_the_last_finish_there_is_ignored() -> None:
    router = make_router(info("A"), info("B"))
    router.apply([stored("A", 0, hashes(PROMPT[:12]))])
    first = route(router, PROMPT)
    assert first.worker == "A"
    busy = {"A": {"num_used_blocks": 1000, "published_at": time.time() - 1.0}, "B": {}}
    router.finished(first)  # after the report: the report still counts this request
    router.set_workers({"A": info("A"), "B": info("B")}, busy)
    assert summary(route(router, PROMPT)) == ("A", "cache", 12)
    busy["A"]["published_at"] = time.time() + 1.0  # a report after that finish: A is busy
    router.set_workers({"A": info("A"), "B": info("B")}, busy)
    assert route(router, PROMPT).reason == "balance"


def test_a_load_report_taken_in_while_a_request_ran_ends_with_it() -> None:
    """A report published and taken in while the request ran counts it; once the request
    finishes, that report is older than the finish and the next round goes back to the cache
    without waiting for the next refresh."""
    router = make_router(info("A"), info("B"))
    router.apply([stored("A", 0, hashes(PROMPT[:12]))])
    first = route(router, PROMPT)
    busy = {"A": {"num_used_blocks": 1000, "published_at": time.time() + 1.0}, "B": {}}
    router.set_workers({"A": info("A"), "B": info("B")}, busy)
    assert route(router, [7, 7, 7]).worker == "B"  # A counts as busy while the request runs
    router.finished(first)
    assert summary(route(router, PROMPT)) == ("A", "cache", 12)


def test_equal_workers_alternate_without_overlap() -> None:
    router = make_router(info("A"), info("B"))
    chosen = []
    for i in range(4):
        decision = route(router, [1000 * (i + 1) + t for t in range(13)])
        assert decision.reason == "balance"
        chosen.append(decision.worker)
        router.finished(decision)
    assert chosen in (["A", "B", "A", "B"], ["B", "A", "B", "A"])


def test_round_robin_ignores_the_cache() -> None:
    router = make_router(info("A"), info("B"), policy="round-robin")
    router.apply([stored("A", 0, hashes(PROMPT[:12]))])
    decisions = []
    for _ in range(4):
        decisions.append(route(router, PROMPT))
        router.finished(decisions[-1])  # else B's pending copy predicts a hit there too
    assert [d.worker for d in decisions] == ["A", "B", "A", "B"]
    assert {d.reason for d in decisions} == {"round-robin"}
    assert [d.predicted_cached_tokens for d in decisions] == [12, 0, 12, 0]


def test_least_load_picks_the_lower_load() -> None:
    stats = {"A": {"num_used_blocks": 10}, "B": {"num_used_blocks": 2}}
    router = make_router(info("A"), info("B"), policy="least-load", stats=stats)
    router.apply([stored("A", 0, hashes(PROMPT[:12]))])
    decisions = [route(router, PROMPT) for _ in range(2)]
    assert [(d.worker, d.reason) for d in decisions] == [("B", "least-load")] * 2
    # 13 tokens hold 4 blocks; the second request shares its 3 full blocks with the first
    assert [d.load_blocks for d in decisions] == [4, 1]
    assert worker_stats(router, "B")["in_flight_blocks"] == 5


def test_restart_empties_the_index_and_old_events_are_stale() -> None:
    router = make_router(info("A"), info("B"))
    router.apply([stored("A", 0, hashes(PROMPT[:12]))])
    router.set_workers({"A": info("A", inc="i2"), "B": info("B")}, {})
    assert worker_stats(router, "A")["indexed_blocks"] == 0
    assert route(router, PROMPT).predicted_cached_tokens == 0
    outcomes = router.apply([stored("A", 1, hashes(PROMPT[:12]), inc="i1")])
    assert outcomes == {"stale": 1}
    assert worker_stats(router, "A")["indexed_blocks"] == 0
    assert router.apply([stored("A", 0, hashes(PROMPT[:4]), inc="i2")]) == {"applied": 1}
    assert worker_stats(router, "A")["incarnation"] == "i2"


def test_cleared_and_removed() -> None:
    index = WorkerIndex(info("A"), max_blocks=100)
    hs = hashes(PROMPT[:12])
    index.apply(stored("A", 0, hs, tier="device"))
    index.apply(stored("A", 1, hs[:2], tier="host"))
    assert index.apply(KVEvent("A", "i1", 2, "removed", "device", list(hs))) == "applied"
    assert (len(index), index.match(hs)) == (2, 2)  # the host copies remain
    assert index.apply(KVEvent("A", "i1", 3, "cleared")) == "applied"
    assert (len(index), index.match(hs)) == (0, 0)


def test_gap_resyncs_and_duplicates_change_nothing() -> None:
    index = WorkerIndex(info("A"), max_blocks=100)
    h = hashes(list(range(20)))
    assert [index.apply(stored("A", s, [h[s]])) for s in (0, 1)] == ["applied"] * 2
    assert index.apply(stored("A", 3, [h[3]])) == "gap"
    assert (len(index), h[3] in index, h[0] in index, h[1] in index) == (1, True, False, False)
    assert (index.last_seq, index.resyncs) == (3, 1)
    assert index.apply(stored("A", 3, [h[4]])) == "duplicate"
    assert index.apply(stored("A", 2, [h[2]])) == "duplicate"
    assert (len(index), h[4] in index, h[2] in index, index.last_seq) == (1, False, False, 3)


def test_a_gap_asks_once_for_that_workers_snapshot() -> None:
    router = make_router(info("A"), info("B"))
    h = hashes(PROMPT[:12])
    router.apply([stored("A", 0, h[:1]), stored("A", 2, h[1:2]), stored("B", 0, h[:1])])
    assert router.take_lost_track() == ["A"]
    assert router.take_lost_track() == []


def test_first_event_after_zero_is_a_gap() -> None:
    router = make_router(info("A"))
    assert router.apply([stored("A", 5, hashes(PROMPT[:4]))]) == {"gap": 1}
    assert worker_stats(router, "A")["resyncs"] == 1
    assert router.apply([stored("A", 6, [])]) == {"applied": 1}
    assert router.stats()["events"] == {"gap": 1, "applied": 1}


def test_lru_bound_drops_the_least_recently_stored() -> None:
    router = make_router(info("A"), max_blocks_per_worker=8)
    h = hashes(list(range(48)))  # 12 hashes
    router.apply([stored("A", i, [x]) for i, x in enumerate(h)])
    assert worker_stats(router, "A")["indexed_blocks"] == 8
    index = WorkerIndex(info("A"), max_blocks=8)
    index.apply(stored("A", 0, h[:8]))
    index.apply(stored("A", 1, h[:1]))  # touching h[0] makes h[1] the oldest
    index.apply(stored("A", 2, h[8:12]))
    assert len(index) == 8
    assert [x in index for x in h] == [True] + [False] * 4 + [True] * 7


def test_shared_store_blocks_count_for_workers_of_that_store() -> None:
    writer = info("W", role="prefill", store_id="redis://x")
    router = make_router(writer, info("B", store_id="redis://x"), info("C", store_id="redis://y"))
    assert router.apply([stored("W", 0, hashes(PROMPT[:12]), tier="store")]) == {"applied": 1}
    assert worker_stats(router, "W")["indexed_blocks"] == 0  # not in the writer's own tiers
    for _ in range(2):
        decision = route(router, PROMPT)
        assert (decision.worker, decision.reason) == ("B", "cache")
        assert decision.predicted_cached_tokens == 12
        router.finished(decision)
    assert router.stats()["stores"] == {"redis://x": 3}


def test_own_blocks_then_store_blocks() -> None:
    router = make_router(info("B", store_id="redis://x"), info("W", store_id="redis://x"))
    hs = hashes(PROMPT[:12])
    router.apply([stored("B", 0, hs[:1]), stored("W", 0, hs, tier="store")])
    router.set_workers({"B": info("B", store_id="redis://x")}, {})
    decision = route(router, PROMPT)
    assert (decision.worker, decision.predicted_cached_tokens) == ("B", 12)


def test_auto_store_cost_is_each_workers_reported_ratio() -> None:
    """Two workers share a store holding the prompt and one holds its first block: the one
    whose store loads cost as much as recomputing (1.0) gains only that block from the store
    copy, the other (0.1) nearly all of it; a fixed store_cost ignores the reports."""
    a, b = info("A", store_id="redis://x"), info("B", store_id="redis://x")
    hs = hashes(PROMPT[:12])

    def chosen(reports: dict[str, Any], **kw: Any) -> str:
        router = make_router(a, b, stats=reports, **{"store_cost": None, **kw})
        router.apply([stored("A", 0, hs[:1]), stored("B", 0, hs, tier="store")])
        return route(router, PROMPT).worker

    slow_a = {"A": {"store_load_cost": 1.0}, "B": {"store_load_cost": 0.1}}
    slow_b = {"A": {"store_load_cost": 0.1}, "B": {"store_load_cost": 1.0}}
    # A: 1 own block + 0.9 * 2 shared saves 2.8 blocks; B: 0.9 * 3 = 2.7
    assert chosen(slow_b) == "A"
    # A: 1 own + 0 * 2 = 1 block; B: 0.9 * 3 = 2.7
    assert chosen(slow_a) == "B"
    router = make_router(a, b, stats=slow_a, store_cost=None)
    assert [worker_stats(router, n)["store_cost"] for n in "AB"] == [1.0, 0.1]
    assert chosen(slow_a, store_cost=0.1) == "A"  # fixed: both at 0.1, A's own block wins
    bad = {"A": {"store_load_cost": "x"}, "B": {"store_load_cost": -1}}
    assert chosen(bad) == "A"  # unusable reports: both keep the default, A's own block wins


def test_workers_gone_and_roles() -> None:
    router = make_router(info("A"), info("B"), info("D", role="decode"))
    router.apply([stored("D", 0, hashes(PROMPT[:12])), stored("A", 0, hashes(PROMPT[:12]))])
    router.set_workers({"B": info("B"), "D": info("D", role="decode")}, {})
    assert router.workers() == ["B", "D"]
    for _ in range(3):
        assert route(router, PROMPT).worker == "B"
    assert router.route(PROMPT, None, role="prefill") is None
    decode = router.route(PROMPT, None, role="decode")
    assert decode is not None and decode.worker == "D"
    assert router.apply([stored("A", 1, [])]) == {"unknown": 1}


def test_finished_after_the_worker_restarted_leaves_the_new_one_alone() -> None:
    router = make_router(info("A"))
    old = route(router, PROMPT)
    router.set_workers({"A": info("A", inc="i2")}, {})
    new = route(router, PROMPT)
    router.finished(old)
    assert (worker_stats(router, "A")["in_flight"], new.incarnation) == (1, "i2")


FOUR = tuple(info(n) for n in "ABCD")
USERS = [f"user-{i}" for i in range(64)]


def test_random_reaches_every_worker_and_a_seed_repeats_the_draws() -> None:
    def draws(seed: int) -> list[str]:
        router = make_router(*FOUR, policy="random", seed=seed)
        decisions = [route(router, PROMPT) for _ in range(64)]
        assert {d.reason for d in decisions} == {"random"}
        return [d.worker for d in decisions]

    first = draws(0)
    assert set(first) == set("ABCD")
    assert draws(0) == first
    assert draws(1) != first


def sessions(router: Router) -> dict[str, str]:
    """Each of USERS' worker for one request (finished at once)."""
    workers = {}
    for user in USERS:
        decision = route(router, PROMPT, user=user)
        assert decision.reason == "session"
        router.finished(decision)
        workers[user] = decision.worker
    return workers


def test_session_keeps_each_user_on_one_worker_and_spreads_users() -> None:
    router = make_router(*FOUR, policy="session")
    first = sessions(router)
    assert set(first.values()) == set("ABCD")
    # Neither a cache elsewhere nor load moves a session.
    router.apply([stored("A", 0, hashes(PROMPT[:12]))])
    busy = {"B": {"num_used_blocks": 1000}, "C": {"num_used_blocks": 1000}}
    router.set_workers({i.name: i for i in FOUR}, busy)
    assert [route(router, PROMPT, user=u).worker for u in USERS] == list(first.values())
    # A stable hash, not Python's per-process hash(): the same mapping in every gateway.
    assert [first[f"user-{i}"] for i in range(6)] == ["B", "A", "B", "C", "D", "A"]
    assert route(router, PROMPT, user="\ud800").reason == "session"  # JSON can carry one


def test_session_moves_only_the_users_of_a_worker_that_leaves() -> None:
    router = make_router(*FOUR, policy="session")
    before = sessions(router)
    router.set_workers({i.name: i for i in FOUR if i.name != "C"}, {})
    after = sessions(router)
    moved = {u for u in USERS if after[u] != before[u]}
    assert moved and moved == {u for u in USERS if before[u] == "C"}
    router.set_workers({i.name: i for i in FOUR}, {})
    assert sessions(router) == before  # C's users come back with it


@pytest.mark.parametrize("user", [None, ""])
def test_session_without_a_user_is_least_load(user: str | None) -> None:
    stats = {"A": {"num_used_blocks": 10}, "B": {"num_used_blocks": 2}}
    router = make_router(info("A"), info("B"), policy="session", stats=stats)
    assert summary(route(router, PROMPT, user=user))[:2] == ("B", "least-load")


@pytest.mark.parametrize("policy", ["round-robin", "least-load", "cache-aware", "random"])
def test_only_the_session_policy_reads_the_user(policy: str) -> None:
    def chosen(user: str | None) -> list[str]:
        router = make_router(*FOUR, policy=policy, seed=0)
        router.apply([stored("B", 0, hashes(PROMPT[:8]))])
        return [route(router, PROMPT, user=user).worker for _ in range(8)]

    assert chosen("user-0") == chosen(None)


@pytest.mark.parametrize(
    "kw",
    [
        {"policy": "sticky"},
        {"overlap_weight": -1.0},
        {"overlap_weight": float("nan")},
        {"max_blocks_per_worker": 0},
        {"store_cost": 1.5},
    ],
)
def test_bad_config_is_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Router(**kw)
