"""What one routing decision costs: the gateway's Router (services/gateway/router.py) with
`workers` workers of `blocks` indexed blocks each, deciding for prompts of `prompt_tokens`
tokens whose first half one worker holds (in process, no servers; `kvserve bench scale`
prints it first). The cost includes hashing the prompt, which dominates."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from kvserve.services.gateway.router import Router
from kvserve.shared.protocol import KVEvent, WorkerInfo
from kvserve.shared.store.hashing import block_hashes, root_hash

BLOCK_SIZE = 16


def _info(name: str) -> WorkerInfo:
    return WorkerInfo(name, "worker", "i", BLOCK_SIZE, "model", "tokenizer", "float32", "", 0.0)


def _filled_router(workers: int, blocks: int, held: list[int]) -> Router:
    infos = {f"w{i}": _info(f"w{i}") for i in range(workers)}
    router = Router(max_blocks_per_worker=blocks)
    router.set_workers(infos, {})
    root = root_hash("model", "tokenizer", "float32", BLOCK_SIZE)
    filler = random.Random(0)
    for i, name in enumerate(infos):
        tokens = held if i == 0 else []
        tokens = tokens + [filler.randrange(50_000) for _ in range(blocks * BLOCK_SIZE)]
        hashes: list[bytes] = list(block_hashes(root, tokens, BLOCK_SIZE)[:blocks])
        router.apply(
            KVEvent(name, "i", seq, "stored", "device", hashes[k : k + 512])
            for seq, k in enumerate(range(0, len(hashes), 512))
        )
    return router


def measure(
    workers: int = 2, blocks: int = 10_000, prompt_tokens: int = 2048, decisions: int = 300
) -> dict[str, Any]:
    """Microseconds per decision (route + finished), median and p99 over `decisions`."""
    rng = random.Random(1)
    shared = [rng.randrange(50_000) for _ in range(prompt_tokens // 2)]
    router = _filled_router(workers, blocks, shared)
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
        "us_median": 1e6 * statistics.median(seconds),
        "us_p99": 1e6 * seconds[int(0.99 * (len(seconds) - 1))],
        "indexed_blocks": [w["indexed_blocks"] for w in router.stats()["workers"].values()],
    }
