"""The model's outputs against a reference: Hugging Face `generate` on one prompt, and two
engines' next-token distributions over the same token sequences, teacher-forced."""

from __future__ import annotations

from typing import Any

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


def hf_generate(model: Any, prompt: list[int], **options: Any) -> list[int]:
    """The tokens HF `model.generate` adds to `prompt` (one sequence, no padding in the input,
    pad id 0) with the generation `options`."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **options)
    return list(out[0, len(prompt) :].tolist())
