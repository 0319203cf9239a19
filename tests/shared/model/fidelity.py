"""Two engines' next-token distributions over the same token sequences, teacher-forced."""

from __future__ import annotations

import torch
from kvserve.shared.engine.engine import Engine


def teacher_forced(
    ref: Engine, other: Engine, prompts: list[list[int]], completions: list[list[int]]
) -> tuple[float, float]:
    """Mean KL(ref || other) over every completion position, and the fraction of positions
    whose argmax agrees. Asserts that `other`'s logits differ from `ref`'s on every sequence
    (its own path really ran)."""
    kls, agree, total = [], 0, 0
    for prompt, completion in zip(prompts, completions, strict=True):
        seq = prompt + completion
        want = ref.score(seq)[len(prompt) - 1 :].log_softmax(-1)
        got = other.score(seq)[len(prompt) - 1 :].log_softmax(-1)
        assert not torch.equal(want, got)
        kls.append((want.exp() * (want - got)).sum(-1))
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        total += want.shape[0]
    return torch.cat(kls).mean().item(), agree / total
