"""Helpers of the engine tests (and of the store tests that drive an engine): prompts of any
length from one fixed text, and driving an engine through one request."""

from __future__ import annotations

from kvserve.shared.model.tokenizer import KVTokenizer

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
