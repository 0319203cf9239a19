"""The workloads of `kvserve bench serve`: prompts as token ids (workloads/tokens.py),
deterministic under a seed.

A workload is a list of `Session`s. A session is one or more turns sent one after another; a
turn's prompt is its own tokens, or, for a session that carries its history (`multi-round`),
every earlier turn's tokens and answers followed by its own. Single requests are sessions of one
turn. Each workload is a frozen spec whose `sessions(vocab_size, seed)` draws them:

- `random` (`RandomLengths`): uniform input / output lengths in [len * (1 - r), len * (1 + r)]
  (vLLM's random).
- `shared-prefix` (`SharedPrefix`): G groups x P prompts, a per-group prefix plus a distinct
  question, fixed output length, shuffled (SGLang's generated-shared-prefix).
- `multi-round` (`MultiRound`): U users x R rounds, one system prompt shared by all users, each
  round appends the previous answer and a new question (LMCache's multi-round QA); a user's
  rounds are sequential.
- `multi-tenant` (`MultiTenant`): T tenants x U users x Q queries, each query its tenant's
  shared context plus a question of its own, single-turn, shuffled (llm-d's precise prefix
  cache benchmark).
- `agentic` (`Agentic`): A agents x R turns carrying their history: a shared system prompt and
  the agent's task, then a tool result appended every turn.
- `mooncake`: the Mooncake FAST'25 trace replayed (workloads/mooncake.py).
- `copy-edit` and `open-ended`: chat requests of real text, one whose answers copy the prompt
  and one whose answers do not (workloads/chat.py).

Every session names its user (`Session.user`), the key a session-affinity router would route it
by: the request's OpenAI `user` under `bench serve --send-user`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from kvserve.services.bench.workloads.tokens import check_vocab, random_tokens

WORKLOADS = ("random", "shared-prefix", "multi-round", "multi-tenant", "agentic", "mooncake",
             "copy-edit", "open-ended")  # fmt: skip


@dataclass
class Turn:
    tokens: list[int]  # appended to the history, then sent
    output_len: int


@dataclass
class Session:
    turns: list[Turn]
    carry_history: bool = False  # multi-round: the prompt is the whole conversation so far
    arrival_s: float | None = None  # trace replay: seconds after the start
    tag: str = ""  # e.g. "g3" (shared-prefix group), "u2" (user), "t17" (trace line)
    user: str = ""  # the user key: sessions with the same key belong to one user
    hash_ids: list[int] = field(default_factory=list)  # mooncake: the (scaled) blocks

    @property
    def num_requests(self) -> int:
        return len(self.turns)


class Workload(Protocol):
    def sessions(self, vocab_size: int, seed: int = 0) -> list[Session]: ...


class SeededWorkload:
    """A workload drawn from one random stream named for it and the seed (so two workloads never
    share their tokens): `sessions` checks the vocabulary and hands the stream to `draw`."""

    name: ClassVar[str]

    def sessions(self, vocab_size: int, seed: int = 0) -> list[Session]:
        check_vocab(vocab_size)
        return self.draw(random.Random(f"{self.name}:{seed}"), vocab_size)

    def draw(self, rng: random.Random, vocab_size: int) -> list[Session]:
        raise NotImplementedError


def _uniform_len(rng: random.Random, length: int, ratio: float) -> int:
    lo = max(1, math.floor(length * (1 - ratio)))
    hi = max(lo, math.ceil(length * (1 + ratio)))
    return rng.randint(lo, hi)


@dataclass(frozen=True)
class RandomLengths(SeededWorkload):
    """`num_requests` single requests, input and output lengths uniform within `range_ratio` of
    the given ones (vLLM's random)."""

    name: ClassVar[str] = "random"
    num_requests: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")

    def draw(self, rng: random.Random, vocab_size: int) -> list[Session]:
        out = []
        for i in range(self.num_requests):
            n_in = _uniform_len(rng, self.input_len, self.range_ratio)
            n_out = _uniform_len(rng, self.output_len, self.range_ratio)
            turn = Turn(random_tokens(rng, n_in, vocab_size), n_out)
            out.append(Session([turn], tag=f"r{i}", user=f"r{i}"))
        return out


@dataclass(frozen=True)
class SharedPrefix(SeededWorkload):
    """`groups` x `prompts_per_group` requests: a group's prefix, then a question of its own."""

    name: ClassVar[str] = "shared-prefix"
    groups: int
    prompts_per_group: int
    prefix_len: int
    question_len: int
    output_len: int

    def draw(self, rng: random.Random, vocab_size: int) -> list[Session]:
        out = []
        for g in range(self.groups):
            prefix = random_tokens(rng, self.prefix_len, vocab_size)
            for _ in range(self.prompts_per_group):
                question = random_tokens(rng, self.question_len, vocab_size)
                turn = Turn(prefix + question, self.output_len)
                out.append(Session([turn], tag=f"g{g}", user=f"g{g}"))
        rng.shuffle(out)
        return out


@dataclass(frozen=True)
class MultiRound(SeededWorkload):
    """`users` conversations of `rounds` rounds after one shared system prompt; `context_len`:
    a context of each user's own (a document, a profile) after the system prompt in the first
    round, as in LMCache's multi-round QA benchmark."""

    name: ClassVar[str] = "multi-round"
    users: int
    rounds: int
    system_len: int
    question_len: int
    output_len: int
    context_len: int = 0

    def draw(self, rng: random.Random, vocab_size: int) -> list[Session]:
        system = random_tokens(rng, self.system_len, vocab_size)
        out = []
        for u in range(self.users):
            turns = [
                Turn(random_tokens(rng, self.question_len, vocab_size), self.output_len)
                for _ in range(self.rounds)
            ]
            context = random_tokens(rng, self.context_len, vocab_size)
            turns[0] = Turn(system + context + turns[0].tokens, self.output_len)
            out.append(Session(turns, carry_history=True, tag=f"u{u}", user=f"u{u}"))
        return out


@dataclass(frozen=True)
class MultiTenant(SeededWorkload):
    """`tenants` x `users_per_tenant` x `queries_per_user` single-turn sessions (llm-d's precise
    prefix cache benchmark): a query's prompt is its tenant's context of `context_len` tokens
    (one draw per tenant, so shared by the tenant's queries only) followed by a question of its
    own. Shuffled, so tenants and users interleave. Tag `t{t}-u{u}-q{q}`, user `t{t}-u{u}`."""

    name: ClassVar[str] = "multi-tenant"
    tenants: int
    users_per_tenant: int
    queries_per_user: int
    context_len: int
    question_len: int
    output_len: int

    def draw(self, rng: random.Random, vocab_size: int) -> list[Session]:
        out = [s for t in range(self.tenants) for s in self._tenant(rng, t, vocab_size)]
        rng.shuffle(out)
        return out

    def _tenant(self, rng: random.Random, t: int, vocab_size: int) -> list[Session]:
        """Tenant t's queries in order: its context drawn once, then a question per query."""
        context = random_tokens(rng, self.context_len, vocab_size)
        out = []
        for u in range(self.users_per_tenant):
            for q in range(self.queries_per_user):
                question = random_tokens(rng, self.question_len, vocab_size)
                turn = Turn(context + question, self.output_len)
                out.append(Session([turn], tag=f"t{t}-u{u}-q{q}", user=f"t{t}-u{u}"))
        return out


@dataclass(frozen=True)
class Agentic(SeededWorkload):
    """`agents` sessions of `turns` turns that carry their history, so each prompt extends the
    previous prompt and its answer: turn 0 is the system prompt (`system_len` tokens, shared by
    every agent) and the agent's own task (`task_len`); every later turn appends a tool result
    (`tool_output_len`). Tag and user `a{k}`."""

    name: ClassVar[str] = "agentic"
    agents: int
    turns: int
    system_len: int
    task_len: int
    tool_output_len: int
    output_len: int

    def draw(self, rng: random.Random, vocab_size: int) -> list[Session]:
        system = random_tokens(rng, self.system_len, vocab_size)
        out = []
        for k in range(self.agents):
            turns = [Turn(system + random_tokens(rng, self.task_len, vocab_size), self.output_len)]
            turns += [
                Turn(random_tokens(rng, self.tool_output_len, vocab_size), self.output_len)
                for _ in range(self.turns - 1)
            ]
            out.append(Session(turns, carry_history=True, tag=f"a{k}", user=f"a{k}"))
        return out
