"""Real text for quality measurements: English prose from Python's own help topics (not in the
repository) and a few chat prompts."""

from __future__ import annotations

from kvserve.shared.model.tokenizer import KVTokenizer

PROMPTS = [
    "Explain how a hash table works.",
    "Write a short story about a lighthouse keeper.",
    "What are the causes of the French Revolution?",
    "Describe the water cycle for a ten-year-old.",
    "Give three tips for learning a new programming language.",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
]


def reference_text(tokenizer: KVTokenizer, n: int) -> list[int]:
    """At least n tokens of English prose from Python's own help topics (not in the repo)."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for key in sorted(topics):
        ids += tokenizer.encode(topics[key])
        if len(ids) >= n:
            return ids[:n]
    raise RuntimeError(f"pydoc topics hold fewer than {n} tokens")


def chat_prompts(tokenizer: KVTokenizer, n: int) -> list[list[int]]:
    """The first `n` of PROMPTS, each as a one-message chat."""
    return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:n]]
