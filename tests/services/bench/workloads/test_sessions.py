"""The workloads of `kvserve bench serve` (services/bench/workloads/sessions.py): deterministic
under a seed, the requested shapes, every token id an ordinary one below the vocabulary size,
each session's user key."""

from __future__ import annotations

from kvserve.services.bench.workloads.sessions import (
    Agentic,
    MultiRound,
    MultiTenant,
    RandomLengths,
    Session,
    SharedPrefix,
)
from kvserve.services.bench.workloads.tokens import MIN_TOKEN_ID

VOCAB = 49152


def all_ids(sessions: list[Session]) -> list[int]:
    return [t for s in sessions for turn in s.turns for t in turn.tokens]


def test_random_workload_shapes_and_determinism() -> None:
    a = RandomLengths(50, 100, 20, 0.5).sessions(VOCAB, seed=1)
    assert a == RandomLengths(50, 100, 20, 0.5).sessions(VOCAB, seed=1)
    assert a != RandomLengths(50, 100, 20, 0.5).sessions(VOCAB, seed=2)
    assert len(a) == 50 and all(len(s.turns) == 1 for s in a)
    ins = [len(s.turns[0].tokens) for s in a]
    outs = [s.turns[0].output_len for s in a]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 10
    assert min(outs) >= 10 and max(outs) <= 30
    fixed = RandomLengths(5, 64, 8, 0.0).sessions(VOCAB)
    assert {len(s.turns[0].tokens) for s in fixed} == {64}
    assert {s.turns[0].output_len for s in fixed} == {8}
    ids = all_ids(a)
    assert min(ids) >= MIN_TOKEN_ID and max(ids) < VOCAB


def test_shared_prefix_workload() -> None:
    s = SharedPrefix(3, 4, 32, 8, 5).sessions(VOCAB, seed=0)
    assert s == SharedPrefix(3, 4, 32, 8, 5).sessions(VOCAB, seed=0)
    assert len(s) == 12
    assert all(len(x.turns[0].tokens) == 40 and x.turns[0].output_len == 5 for x in s)
    by_group: dict[str, list[list[int]]] = {}
    for x in s:
        by_group.setdefault(x.tag, []).append(x.turns[0].tokens)
    assert len(by_group) == 3 and all(len(v) == 4 for v in by_group.values())
    prefixes = {tuple(v[0][:32]) for v in by_group.values()}
    assert len(prefixes) == 3  # one prefix per group, distinct across groups
    for v in by_group.values():
        assert len({tuple(p[:32]) for p in v}) == 1  # shared within the group
        assert len({tuple(p[32:]) for p in v}) == 4  # distinct questions
    assert [x.tag for x in s] != sorted(x.tag for x in s)  # shuffled
    ids = all_ids(s)
    assert min(ids) >= MIN_TOKEN_ID and max(ids) < VOCAB


def test_multi_round_workload() -> None:
    s = MultiRound(3, 4, 50, 10, 6).sessions(1000, seed=3)
    assert s == MultiRound(3, 4, 50, 10, 6).sessions(1000, seed=3)
    assert len(s) == 3 and all(x.carry_history and len(x.turns) == 4 for x in s)
    system = s[0].turns[0].tokens[:50]
    for x in s:
        assert x.turns[0].tokens[:50] == system and len(x.turns[0].tokens) == 60
        assert all(len(t.tokens) == 10 and t.output_len == 6 for t in x.turns[1:])
    ids = all_ids(s)
    assert min(ids) >= MIN_TOKEN_ID and max(ids) < 1000


def test_multi_round_users_have_contexts_of_their_own() -> None:
    sessions = MultiRound(3, 2, 8, 4, 2, context_len=16).sessions(vocab_size=1000)
    firsts = [s.turns[0].tokens for s in sessions]
    assert all(len(t) == 8 + 16 + 4 for t in firsts)
    assert len({tuple(t[:8]) for t in firsts}) == 1  # the shared system prompt
    assert len({tuple(t[8:24]) for t in firsts}) == 3  # each user's own context


def test_multi_tenant_workload() -> None:
    """3 tenants x 2 users x 2 queries: a tenant's 32-token context shared by its queries only,
    an 8-token question each, interleaved, keyed by tenant and user."""
    spec = MultiTenant(3, 2, 2, 32, 8, 5)
    s = spec.sessions(VOCAB, seed=0)
    assert s == spec.sessions(VOCAB, seed=0) and s != spec.sessions(VOCAB, seed=1)
    assert len(s) == 12 and not any(x.carry_history for x in s)
    assert all(len(x.turns) == 1 and len(x.turns[0].tokens) == 40 for x in s)
    assert {x.turns[0].output_len for x in s} == {5}
    tags = [x.tag for x in s]
    expected = {f"t{t}-u{u}-q{q}" for t in range(3) for u in range(2) for q in range(2)}
    assert set(tags) == expected and tags != sorted(tags)  # every query once, shuffled
    assert all(x.user == x.tag.rpartition("-")[0] for x in s)
    contexts: dict[str, set[tuple[int, ...]]] = {}
    for x in s:
        contexts.setdefault(x.tag.partition("-")[0], set()).add(tuple(x.turns[0].tokens[:32]))
    assert all(len(c) == 1 for c in contexts.values())  # shared within a tenant
    assert len(set().union(*contexts.values())) == 3  # not across tenants
    assert len({tuple(x.turns[0].tokens[32:]) for x in s}) == 12  # a question each
    ids = all_ids(s)
    assert min(ids) >= MIN_TOKEN_ID and max(ids) < VOCAB


def test_agentic_workload() -> None:
    """3 agents x 4 turns: a shared 16-token system prompt and a 6-token task of each agent's
    own, then 10-token tool results; histories carried, one user per agent."""
    spec = Agentic(3, 4, 16, 6, 10, 5)
    s = spec.sessions(1000, seed=2)
    assert s == spec.sessions(1000, seed=2) and s != spec.sessions(1000, seed=3)
    assert [(x.tag, x.user) for x in s] == [(f"a{k}", f"a{k}") for k in range(3)]
    assert all(x.carry_history and len(x.turns) == 4 for x in s)
    firsts = [x.turns[0].tokens for x in s]
    assert all(len(t) == 22 for t in firsts)
    assert len({tuple(t[:16]) for t in firsts}) == 1  # the shared system prompt
    assert len({tuple(t[16:]) for t in firsts}) == 3  # each agent's own task
    later = [t for x in s for t in x.turns[1:]]
    assert all(len(t.tokens) == 10 for t in later)
    assert {t.output_len for x in s for t in x.turns} == {5}
    ids = all_ids(s)
    assert min(ids) >= MIN_TOKEN_ID and max(ids) < 1000


def test_user_keys_of_the_other_workloads() -> None:
    assert [x.user for x in RandomLengths(3, 8, 2).sessions(VOCAB)] == ["r0", "r1", "r2"]
    assert all(x.user == x.tag for x in SharedPrefix(3, 2, 8, 4, 2).sessions(VOCAB))
    assert [x.user for x in MultiRound(2, 2, 8, 4, 2).sessions(VOCAB)] == ["u0", "u1"]
