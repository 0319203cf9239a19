"""The workloads of `kvserve bench serve` (services/bench/workloads/sessions.py): deterministic
under a seed, the requested shapes, every token id an ordinary one below the vocabulary size."""

from __future__ import annotations

from kvserve.services.bench.workloads.sessions import (
    MultiRound,
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
