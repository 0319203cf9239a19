"""The model against Hugging Face transformers running the same weights (fp32, CPU).

The GGUF test loads the default model's GGUF with `AutoModelForCausalLM.from_pretrained(dir,
gguf_file=...)`; the MHA/MQA tests build tiny random Llama models in HF layout in a temp dir.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.model.fidelity import hf_generate
from tests.shared.model.tiny_llama import save_tiny_llama

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-3
GEN_TOKENS = 64


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    return hf_generate(model, prompt, max_new_tokens=n, do_sample=False, eos_token_id=None)


def test_tokenizer_matches_hf(model_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    hf_tok = transformers.AutoTokenizer.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name
    )
    texts = [
        "Hello, world!",
        "  leading spaces and\ttabs\nnewlines",
        "numbers 12345 and 3.14159",
        "unicode: café, naïve, 日本語, emoji 🚀",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    for text in texts:
        assert tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tokenizer.apply_chat_template(msgs) == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow  # the default run stays within its time on the slowest CPUs
def test_gguf_greedy_and_logits_match_hf(  # type: ignore[no-untyped-def]
    make_engine, hf_gguf_model, chat_prompt_ids
) -> None:
    engine = make_engine()
    ours = engine.generate(chat_prompt_ids, SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True))
    for prompt, completions in zip(chat_prompt_ids, ours, strict=True):
        with torch.inference_mode():
            hf_logits = hf_gguf_model(torch.tensor([prompt])).logits[0, -1]
        our_logits = engine.score(prompt)[-1]
        assert (our_logits - hf_logits).abs().max().item() < LOGIT_ATOL
        assert completions[0] == hf_greedy(hf_gguf_model, prompt, GEN_TOKENS)


@pytest.mark.parametrize("num_kv_heads", [4, 1], ids=["mha", "mqa"])
def test_tiny_hf_layout_models_match_hf(  # type: ignore[no-untyped-def]
    tmp_path: Path, tokenizer, num_kv_heads: int
) -> None:
    from kvserve.shared.config import CacheConfig, EngineConfig
    from kvserve.shared.engine.engine import Engine

    hf = save_tiny_llama(tmp_path, tokenizer, num_kv_heads)
    engine = Engine(
        EngineConfig(model_path=str(tmp_path), cache=CacheConfig(num_blocks=64)),
    )
    assert engine.model_config.num_kv_heads == num_kv_heads
    prompts = [tokenizer.encode(t) for t in ["The quick brown fox", "Once upon a time there"]]
    ours = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, completions in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            hf_logits = hf(torch.tensor([prompt])).logits[0, -1]
        assert (engine.score(prompt)[-1] - hf_logits).abs().max().item() < LOGIT_ATOL
        assert completions[0] == hf_greedy(hf, prompt, 24)
