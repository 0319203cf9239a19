"""Quality of an engine's output against a reference on real text: perplexity and the mean
KL divergence of the next-token distributions (`text_metrics`), greedy agreement with
reference tokens (`agreement`)."""

from __future__ import annotations

import torch
from kvserve.shared.engine.engine import Engine
from kvserve.shared.sampling_params import SamplingParams


def text_metrics(ref: torch.Tensor, quant: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """ref/quant logits [T, V] over `ids`: perplexities and mean KLD of next-token dists."""
    target = torch.tensor(ids[1:])
    lp_ref = torch.log_softmax(ref[:-1], -1)
    lp_q = torch.log_softmax(quant[:-1], -1)
    nll_ref = -lp_ref.gather(1, target[:, None]).mean()
    nll_q = -lp_q.gather(1, target[:, None]).mean()
    kld = (lp_ref.exp() * (lp_ref - lp_q)).sum(-1).mean()
    ppl_ref, ppl_q = float(nll_ref.exp()), float(nll_q.exp())
    return {"ppl_ref": ppl_ref, "ppl": ppl_q, "ppl_delta": ppl_q / ppl_ref - 1, "kld": float(kld)}


def agreement(engine: Engine, prompts: list[list[int]], refs: list[list[int]]) -> dict[str, float]:
    """Teacher-forced top-1 agreement with the reference tokens, and free-running prefix."""
    hits = total = 0
    for prompt, ref in zip(prompts, refs, strict=True):
        logits = engine.score(prompt + ref[:-1])[len(prompt) - 1 :]  # predicts ref[0..]
        hits += int((logits.argmax(-1) == torch.tensor(ref)).sum())
        total += len(ref)
    params = SamplingParams(max_tokens=len(refs[0]), ignore_eos=True)
    free = engine.generate(prompts, params)
    same = []
    for out, ref in zip(free, refs, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(out[0], ref, strict=True)) if a != b), len(ref))
        same.append(n)
    return {"agree": hits / total, "free_prefix_mean": sum(same) / len(same)}
