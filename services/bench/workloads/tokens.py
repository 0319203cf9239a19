"""Random prompt tokens, the one generator every benchmark draws from.

Token ids are drawn uniformly from [MIN_TOKEN_ID, vocab_size): the low ids hold the special
tokens of Llama-family vocabularies (SmolLM2's are 0..16), and sending ids rather than text
means every server or engine under test sees exactly the same tokens.
"""

from __future__ import annotations

import random

MIN_TOKEN_ID = 100
DEFAULT_VOCAB_SIZE = 49152  # SmolLM2's


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n)]


def check_vocab(vocab_size: int) -> None:
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab size must be > {MIN_TOKEN_ID}, got {vocab_size}")
