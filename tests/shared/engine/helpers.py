"""Helpers of the engine tests (and of the store and service tests that drive an engine):
prompts of any length from one fixed text, a hand-made prompt Sequence, and one request run
through an engine to its end."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Any

from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.sequence import SeqId, Sequence
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.hashing import BlockHash

TEXTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "In 1969, astronauts landed on the Moon and walked across its dusty grey surface.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen in plants.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and some warm milk.",
    "Once upon a time, in a kingdom by the sea, there lived a princess who loved maps.",
    "Prime numbers such as 2, 3, 5, 7, 11 and 13 have exactly two distinct divisors.",
    "The committee will meet on Tuesday to discuss the budget for the new library wing.",
]


def long_ids(tokenizer: KVTokenizer, i: int) -> list[int]:
    """Every one of TEXTS, starting from the i-th (cyclically), as one tokenized text: slice it
    for a prompt of the length wanted."""
    text = " ".join(TEXTS[(i + k) % len(TEXTS)] for k in range(len(TEXTS)))
    return list(tokenizer.encode(text))


def prompt_sequence(
    seq_id: int,
    token_ids: Iterable[int],
    params: SamplingParams | None = None,
    *,
    request_id: str | None = None,
    arrival: int | None = None,
    root_hash: BlockHash | None = None,
) -> Sequence:
    """A waiting Sequence that holds only its prompt and no blocks: completion 0 of request
    `r{seq_id}`, arrived `seq_id`-th, default SamplingParams, unless told otherwise."""
    tokens = list(token_ids)
    return Sequence(
        seq_id=SeqId(seq_id),
        request_id=f"r{seq_id}" if request_id is None else request_id,
        index=0,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        params=SamplingParams() if params is None else params,
        arrival=seq_id if arrival is None else arrival,
        root_hash=root_hash,
    )


def run_one(
    engine: Engine, request_id: str, prompt: Seq[int], params: SamplingParams, **request: Any
) -> tuple[list[int], int]:
    """Add one request (`request`: add_request's keyword arguments, such as cache_salt or
    kv_tail) and step the engine until nothing is left. Returns the tokens of its first
    completion and the prompt tokens the engine reported cached (0 if it reported none)."""
    engine.add_request(request_id, list(prompt), params, **request)
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.completions[0].token_ids
            cached = out.num_cached_tokens
    return tokens, cached


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 50}  # sampling settings that vary a draw


def assert_no_leak(engine: Engine) -> None:
    """Nothing left: no request, no queued sequence, every block free, the pool consistent."""
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    engine.kv.pool.check()
