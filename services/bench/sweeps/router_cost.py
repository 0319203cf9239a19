"""What the gateway's Router (services/gateway/router.py) costs, in process, no servers
(`kvserve bench scale` prints the decision time first; `kvserve bench fleet --router-only`
prints all of it):

- `measure`: one routing decision (route + finished) with `workers` workers of `blocks` indexed
  blocks each, for prompts of `prompt_tokens` tokens whose first half one worker (`shared_by`
  "one") or every worker ("all": a system prompt every worker holds) holds. The cost includes
  hashing the prompt, which dominates at few workers.
- `apply_rate`: how many KV events (of `hashes_per_event` block hashes, stored then removed, as
  a worker's cache turns over) the router applies per second, against which the fleet's event
  rate is set (a router slower than its workers' events falls behind without bound).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from kvserve.services.gateway.router import Router
from kvserve.shared.protocol import KVEvent, WorkerInfo
from kvserve.shared.store.hashing import block_hashes, root_hash

BLOCK_SIZE = 16
EVENT_HASHES = 512  # a worker's publisher merges at most this many hashes an event


def _info(name: str) -> WorkerInfo:
    return WorkerInfo(name, "worker", "i", BLOCK_SIZE, "model", "tokenizer", "float32", "", 0.0)


def _filled_router(workers: int, blocks: int, held: list[int], shared_by: str) -> Router:
    infos = {f"w{i}": _info(f"w{i}") for i in range(workers)}
    router = Router(max_blocks_per_worker=blocks)
    router.set_workers(infos, {})
    root = root_hash("model", "tokenizer", "float32", BLOCK_SIZE)
    filler = random.Random(0)
    for i, name in enumerate(infos):
        tokens = held if i == 0 or shared_by == "all" else []
        tokens = tokens + [filler.randrange(50_000) for _ in range(blocks * BLOCK_SIZE)]
        hashes: list[bytes] = list(block_hashes(root, tokens, BLOCK_SIZE)[:blocks])
        router.apply(
            KVEvent(name, "i", seq, "stored", "device", hashes[k : k + EVENT_HASHES])
            for seq, k in enumerate(range(0, len(hashes), EVENT_HASHES))
        )
    return router


def measure(
    workers: int = 2,
    blocks: int = 10_000,
    prompt_tokens: int = 2048,
    decisions: int = 300,
    shared_by: str = "one",
) -> dict[str, Any]:
    """Microseconds per decision (route + finished), median and p99 over `decisions`."""
    rng = random.Random(1)
    shared = [rng.randrange(50_000) for _ in range(prompt_tokens // 2)]
    router = _filled_router(workers, blocks, shared, shared_by)
    seconds = []
    for _ in range(decisions):
        prompt = shared + [rng.randrange(50_000) for _ in range(prompt_tokens - len(shared))]
        t0 = time.perf_counter()
        decision = router.route(prompt, None)
        assert decision is not None
        router.finished(decision)
        seconds.append(time.perf_counter() - t0)
    seconds.sort()
    return {
        "workers": workers,
        "blocks_per_worker": blocks,
        "prompt_tokens": prompt_tokens,
        "shared_by": shared_by,
        "us_median": 1e6 * statistics.median(seconds),
        "us_p99": 1e6 * seconds[int(0.99 * (len(seconds) - 1))],
        "indexed_blocks": [w["indexed_blocks"] for w in router.stats()["workers"].values()],
    }


def apply_rate(
    workers: int = 64, blocks: int = 10_000, events: int = 2000, hashes_per_event: int = 16
) -> dict[str, Any]:
    """Events and block hashes the router applies per second, with `workers` workers whose
    indexes hold `blocks` blocks each (full, so every stored hash evicts one)."""
    router = _filled_router(workers, blocks, [], "one")
    rng = random.Random(2)
    names = [f"w{i}" for i in range(workers)]
    seq = {n: blocks // EVENT_HASHES + (blocks % EVENT_HASHES > 0) for n in names}
    batch = []
    for _ in range(events):
        name = rng.choice(names)
        hashes = [rng.randbytes(32) for _ in range(hashes_per_event)]
        batch.append(KVEvent(name, "i", seq[name], "stored", "device", hashes))
        seq[name] += 1
    t0 = time.perf_counter()
    outcomes = router.apply(batch)
    seconds = time.perf_counter() - t0
    assert outcomes == {"applied": events}, outcomes
    return {
        "workers": workers,
        "hashes_per_event": hashes_per_event,
        "events_per_s": events / seconds,
        "hashes_per_s": events * hashes_per_event / seconds,
    }
