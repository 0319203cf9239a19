"""KV-cache-aware routing: which engine worker gets a request.

Workers publish KVEvents; the router keeps, per live worker, a `WorkerIndex` of the chain hashes
its device and host tiers hold, and, per shared persistent store (a non-empty
`WorkerInfo.store_id`), one index of the hashes any worker wrote there. `route` hashes the prompt
with each candidate's block identity, predicts how many leading blocks each one already holds
and picks one by policy:

- "round-robin": the next candidate in sorted-name order.
- "least-load": the smallest load.
- "cache-aware": the smallest cost = overlap_weight * prefill_blocks + load, where
  prefill_blocks = prompt_blocks - own - (1 - store_cost) * shared (NVIDIA Dynamo's KV router
  cost, with a block from the shared store counted as partly cached). store_cost None
  ("auto"): each worker's own reported `store_load_cost` (what a store load costs it against
  recomputing, the ratio its fetch rule weighs), DEFAULT_STORE_COST until it reports one.
- "random": a uniformly random candidate (`Router(seed=...)` makes the draws reproducible).
- "session": sticky by the request's session key (the OpenAI `user`; vLLM production-stack's
  session router): the candidate with the highest blake2b(key, name) weight (rendezvous
  hashing), so a key keeps its worker while that worker lives and only the keys of a worker
  that leaves move; a request without a key (None or "") goes to the least-loaded worker.

Invariants:
- A worker's index only holds blocks from events of its current incarnation, applied in `seq`
  order; a gap in `seq` drops the whole index (it is rebuilt from later events), a restart
  (new incarnation) starts an empty one. Both indexes are LRU-bounded: the least recently
  stored hash goes first.
- The shared-store index is only fed ("stored", tier "store"); a store evicts silently, so a stale
  entry costs a misprediction, never a wrong block (the engine checks every block it reads).
- In-flight load and pending hashes count exactly the decisions not yet `finished`; pending
  hashes make back-to-back requests of one prefix see each other before any event arrives, and
  a request finished with its prompt computed leaves its blocks in its worker's index (the
  worker's own events confirm or remove them later).
- load = max(blocks of in-flight requests routed here, the worker's reported num_used_blocks).
  A report is used only when the worker published it after the last request this router saw
  finish there (its `published_at`): a report up to a heartbeat old would still count a
  finished conversation's blocks and send its next round away from its cache.
- Ties go to fewer in-flight requests, then to a rotating order, so equal workers alternate.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.services.gateway.block_index import (
    BlockHolders,
    WorkerIndex,
    leading,
    leading_runs,
    runs_from,
)
from kvserve.shared.protocol import KVEvent, WorkerInfo
from kvserve.shared.store.hashing import block_hashes, root_hash

POLICIES = ("round-robin", "least-load", "cache-aware", "random", "session")
STORE_TIER = "store"
# A shared-store index holds this many times a worker's bound.
_STORE_FACTOR = 4

Identity = tuple[str, str, str, int]


# A store-held block's cost as a fraction of recomputing it, for a worker that has not reported
# its own: loads from Redis measured at a fifth to a third of recomputing on a CPU engine.
DEFAULT_STORE_COST = 0.2


@dataclass(frozen=True)
class Decision:
    """Where one request went and why. `hashes` are the prompt's chain hashes under the chosen
    worker's identity; `load_blocks` is what the request adds to its in-flight load."""

    worker: str
    reason: str
    predicted_cached_tokens: int
    prompt_blocks: int
    hashes: tuple[bytes, ...]
    load_blocks: int
    incarnation: str = ""
    role: str = "worker"


@dataclass
class _Worker:
    """The router's view of one live worker: its index and the decisions not yet finished
    (their hashes counted in `pending`, and marked with the worker's bit in the router's
    pending holders while the count is above 0)."""

    index: WorkerIndex
    used_blocks: int = 0
    requests: int = 0
    blocks: int = 0
    pending: Counter[bytes] = field(default_factory=Counter)
    finished_at: float = 0.0  # wall time of the last request seen finishing here
    store_cost: float = DEFAULT_STORE_COST  # its reported store_load_cost (router's is auto)

    @property
    def bit(self) -> int:
        return self.index.bit

    def load(self) -> int:
        return max(self.blocks, self.used_blocks)


@dataclass(frozen=True)
class _Candidate:
    """One worker's prediction for one prompt."""

    name: str
    hashes: tuple[bytes, ...]
    own: int
    shared: int
    load: int
    requests: int


class Router:
    """Picks a worker per request (see the module docstring). Owns every index; mutated only
    by `set_workers`, `apply`, `route` and `finished`. `seed` seeds the "random" policy."""

    def __init__(
        self,
        policy: str = "cache-aware",
        overlap_weight: float = 1.0,
        max_blocks_per_worker: int = 100_000,
        store_cost: float | None = DEFAULT_STORE_COST,
        seed: int | None = None,
    ) -> None:
        _check_config(policy, overlap_weight, max_blocks_per_worker, store_cost)
        self.policy = policy
        self.overlap_weight = overlap_weight
        self.max_blocks_per_worker = max_blocks_per_worker
        self.store_cost = store_cost
        self._workers: dict[str, _Worker] = {}
        self._slots: dict[str, int] = {}  # worker name -> its bit in the holders' masks
        self._held = BlockHolders()  # every worker's indexed blocks
        self._pending = BlockHolders()  # blocks of requests routed and not finished
        self._stores: dict[str, OrderedDict[bytes, None]] = {}
        self._turn = 0
        self._rng = random.Random(seed)
        self._decisions: Counter[str] = Counter()
        self._events: Counter[str] = Counter()
        self._lost_track: set[str] = set()  # workers whose events had a gap

    def set_workers(
        self, infos: Mapping[str, WorkerInfo], stats: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """Make `infos` the live set; a worker gone is forgotten, a restarted one starts empty."""
        for name in [n for n in self._workers if n not in infos]:
            self._drop(name)
            del self._slots[name]
        for name, info in infos.items():
            worker = self._workers.get(name)
            if worker is None or worker.index.info.incarnation != info.incarnation:
                if worker is not None:
                    self._drop(name)
                bit = self._slot(name)
                index = WorkerIndex(info, self.max_blocks_per_worker, self._held, bit)
                worker = _Worker(index)
                self._workers[name] = worker
            worker.index.info = info
            report = stats.get(name, {})
            fresh = _number(report.get("published_at", math.inf)) > worker.finished_at
            worker.used_blocks = int(_number(report.get("num_used_blocks", 0))) if fresh else 0
            cost = report.get("store_load_cost")
            if _number(cost) == cost:  # a number >= 0; anything else keeps the last one
                worker.store_cost = min(1.0, float(cost))
        live_stores = {info.store_id for info in infos.values()}
        for store_id in [s for s in self._stores if s not in live_stores]:
            del self._stores[store_id]

    def _slot(self, name: str) -> int:
        """The worker's bit: kept while its name is live, else the lowest one free."""
        if name not in self._slots:
            used = set(self._slots.values())
            self._slots[name] = next(1 << k for k in range(len(used) + 1) if 1 << k not in used)
        return self._slots[name]

    def _drop(self, name: str) -> None:
        """Forget a worker's blocks and pending hashes (its bit cleared everywhere)."""
        worker = self._workers.pop(name)
        worker.index.forget()
        for h in worker.pending:
            self._pending.discard(h, worker.bit)

    def apply(self, events: Iterable[KVEvent]) -> Counter[str]:
        """Apply events in order; the outcomes counted ("unknown": no such live worker)."""
        outcomes: Counter[str] = Counter(self._apply_one(e) for e in events)
        self._events.update(outcomes)
        return outcomes

    def route(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        role: str = "worker",
        user: str | None = None,
        reason: str | None = None,
    ) -> Decision | None:
        """Pick a worker of `role` for the prompt and count the request in flight there; None
        when no live worker has that role. `user` is the session key (only "session" reads it);
        `reason` replaces the policy's reason (the caller knows why it asked)."""
        names = sorted(n for n, w in self._workers.items() if w.index.info.role == role)
        if not names:
            return None
        candidates = self._candidates(names, _PromptHasher(prompt_token_ids, cache_salt))
        chosen, why = self._choose(candidates, user)
        return self._record(chosen, reason or why, len(prompt_token_ids))

    def finished(self, decision: Decision, computed: bool = False) -> None:
        """Undo `decision`'s in-flight load and pending hashes (nothing if its worker is gone
        or restarted since): its request ended there. `computed`: its worker reported the
        prompt processed, so the prompt's blocks are in that worker's cache now: they stay in
        its index (as device blocks) rather than vanish until its KV events arrive, which
        would send the next request of the same prefix elsewhere in the meantime."""
        worker = self._workers.get(decision.worker)
        if worker is not None and worker.index.info.incarnation == decision.incarnation:
            worker.finished_at = time.time()
            worker.used_blocks = 0  # the report in use predates this finish (see set_workers)
            if computed:
                worker.index.remember(decision.hashes)
        self._release(decision)

    def withdraw(self, decision: Decision) -> None:
        """Undo `decision` as one not taken after all (its request went elsewhere): its load,
        its pending hashes and its count among the decisions."""
        self._decisions[decision.reason] -= 1
        if self._decisions[decision.reason] <= 0:
            del self._decisions[decision.reason]
        self._release(decision)

    def _release(self, decision: Decision) -> None:
        worker = self._workers.get(decision.worker)
        if worker is None or worker.index.info.incarnation != decision.incarnation:
            return
        worker.requests = max(0, worker.requests - 1)
        worker.blocks = max(0, worker.blocks - decision.load_blocks)
        for h in decision.hashes:
            left = worker.pending[h] - 1
            if left > 0:
                worker.pending[h] = left
            elif worker.pending.pop(h, None) is not None:
                self._pending.discard(h, worker.bit)

    def take_lost_track(self) -> list[str]:
        """Workers whose events had a gap since the last call (to ask for a snapshot)."""
        out, self._lost_track = sorted(self._lost_track), set()
        return out

    def workers(self) -> list[str]:
        return sorted(self._workers)

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "decisions": dict(self._decisions),
            "events": dict(self._events),
            "workers": {name: _worker_stats(w) for name, w in sorted(self._workers.items())},
            "stores": {store_id: len(index) for store_id, index in self._stores.items()},
        }

    def _apply_one(self, event: KVEvent) -> str:
        worker = self._workers.get(event.worker)
        if worker is None:
            return "unknown"
        outcome = worker.index.apply(event)
        if outcome == "gap":
            self._lost_track.add(event.worker)
        shared = event.op == "stored" and event.tier == STORE_TIER
        if shared and outcome in ("applied", "gap"):
            self._store_blocks(worker.index.info.store_id, event.block_hashes)
        return outcome

    def _store_blocks(self, store_id: str, hashes: Iterable[bytes]) -> None:
        if not store_id:
            return
        index = self._stores.setdefault(store_id, OrderedDict())
        for h in hashes:
            index[h] = None
            index.move_to_end(h)
        while len(index) > self.max_blocks_per_worker * _STORE_FACTOR:
            index.popitem(last=False)

    def _candidates(self, names: list[str], hasher: _PromptHasher) -> list[_Candidate]:
        """Each worker's prediction: `own`, the leading run its index or pending requests
        hold (one walk over the prompt for all the workers of one block identity), and
        `shared`, the run its store holds after that (one walk per store)."""
        groups: dict[Identity, list[str]] = {}
        for name in names:
            groups.setdefault(_identity(self._workers[name].index.info), []).append(name)
        out: dict[str, _Candidate] = {}
        for group in groups.values():
            hashes = hasher.hashes(self._workers[group[0]].index.info)
            slots = {n: self._workers[n].bit for n in group}
            own = leading_runs(hashes, slots, self._held, self._pending)
            ends: dict[str, list[int]] = {}
            for name in group:
                worker = self._workers[name]
                store_id = worker.index.info.store_id
                store = self._stores.get(store_id)
                if store and store_id not in ends:
                    ends[store_id] = runs_from(hashes, store.__contains__)
                shared = ends[store_id][own[name]] - own[name] if store else 0
                load = worker.load()
                out[name] = _Candidate(name, hashes, own[name], shared, load, worker.requests)
        return [out[n] for n in names]

    def _choose(self, candidates: list[_Candidate], user: str | None) -> tuple[_Candidate, str]:
        """`candidates` are in name order, which makes every choice below deterministic (for
        "random": given the seed)."""
        n = len(candidates)
        turn = {c.name: (i - self._turn) % n for i, c in enumerate(candidates)}
        if self.policy == "round-robin":
            return min(candidates, key=lambda c: turn[c.name]), "round-robin"
        if self.policy == "random":
            return self._rng.choice(candidates), "random"
        if self.policy == "session" and user:
            return max(candidates, key=lambda c: _rendezvous_weight(user, c.name)), "session"
        if self.policy in ("least-load", "session"):  # "session": a request without a key
            return min(candidates, key=lambda c: (c.load, turn[c.name])), "least-load"
        return self._cache_aware(candidates, turn)

    def _cache_aware(
        self, candidates: list[_Candidate], turn: Mapping[str, int]
    ) -> tuple[_Candidate, str]:
        chosen = min(candidates, key=lambda c: (self._cost(c), c.requests, turn[c.name]))
        best = max(self._overlap(c) for c in candidates)
        overlap = self._overlap(chosen)
        return chosen, "cache" if overlap > 0 and overlap >= best else "balance"

    def _overlap(self, c: _Candidate) -> float:
        """Blocks the candidate saves from prefill, a shared-store block counted partly."""
        if not c.shared:
            return c.own
        cost = self.store_cost if self.store_cost is not None else self._workers[c.name].store_cost
        return c.own + (1.0 - cost) * c.shared

    def _cost(self, c: _Candidate) -> float:
        return self.overlap_weight * (len(c.hashes) - self._overlap(c)) + c.load

    def _record(self, c: _Candidate, reason: str, prompt_len: int) -> Decision:
        worker = self._workers[c.name]
        info = worker.index.info
        # The blocks the request holds while it runs, less the prefix it shares with requests
        # in flight there (the engine holds those blocks once).
        shared = leading(c.hashes, worker.pending.__contains__)
        load_blocks = prompt_len // info.block_size + 1 - shared
        self._turn += 1
        self._decisions[reason] += 1
        worker.requests += 1
        worker.blocks += load_blocks
        for h in c.hashes:
            if not worker.pending[h]:
                self._pending.add(h, worker.bit)
            worker.pending[h] += 1
        predicted = (c.own + c.shared) * info.block_size
        return Decision(
            c.name,
            reason,
            predicted,
            len(c.hashes),
            c.hashes,
            load_blocks,
            info.incarnation,
            info.role,
        )


class _PromptHasher:
    """A prompt's chain hashes, computed once per block identity."""

    def __init__(self, tokens: Sequence[int], cache_salt: str | None) -> None:
        self.tokens = tokens
        self.cache_salt = cache_salt
        self._memo: dict[Identity, tuple[bytes, ...]] = {}

    def hashes(self, info: WorkerInfo) -> tuple[bytes, ...]:
        key = _identity(info)
        if key not in self._memo:
            self._memo[key] = self._compute(key)
        return self._memo[key]

    def _compute(self, key: Identity) -> tuple[bytes, ...]:
        bs = key[3]
        limit = max(0, (len(self.tokens) - 1) // bs)  # the last token is always computed
        root = root_hash(*key, self.cache_salt)
        return tuple(block_hashes(root, self.tokens[: limit * bs], bs))


def _identity(info: WorkerInfo) -> Identity:
    """What a worker's blocks' chain hashes depend on, besides the salt."""
    return (info.model_fp, info.tokenizer_fp, info.kv_format, info.block_size)


def _rendezvous_weight(key: str, worker: str) -> bytes:
    """`worker`'s weight for session `key`: the same in every process and run (Python's hash()
    of a str is salted per process, so gateways would disagree). The key is any client string,
    a lone surrogate included ("surrogatepass" encodes it rather than failing the request);
    the NUL keeps one (key, worker) pair from spelling another's bytes."""
    data = f"{key}\0{worker}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=8).digest()


def _check_config(policy: str, weight: float, max_blocks: int, store_cost: float | None) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; one of {POLICIES}")
    if not math.isfinite(weight) or weight < 0:
        raise ValueError("overlap_weight must be a finite number >= 0")
    if max_blocks < 1:
        raise ValueError("max_blocks_per_worker must be at least 1")
    if store_cost is not None and not 0.0 <= store_cost <= 1.0:
        raise ValueError("store_cost must be in [0, 1] (or None: each worker's own)")


def _number(value: Any) -> float:
    """A reported number, 0 for anything else (a report is untrusted input)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
    return max(0.0, float(value)) if ok else 0.0


def _worker_stats(worker: _Worker) -> dict[str, Any]:
    return {
        "indexed_blocks": len(worker.index),
        "in_flight": worker.requests,
        "in_flight_blocks": worker.blocks,
        "last_seq": worker.index.last_seq,
        "incarnation": worker.index.info.incarnation,
        "resyncs": worker.index.resyncs,
        "store_cost": worker.store_cost,
    }
