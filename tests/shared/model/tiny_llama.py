"""A tiny random Llama in Hugging Face layout, for the tests that load a model from a directory
(MHA, GQA and MQA alike) without the default model's weights."""

from __future__ import annotations

from pathlib import Path

import torch
from kvserve.shared.model.tokenizer import KVTokenizer


def save_tiny_llama(path: Path, tokenizer: KVTokenizer, num_kv_heads: int) -> torch.nn.Module:
    """A 2-layer Llama (4 query heads, hidden 64) with random weights, saved in Hugging Face
    layout (config.json, safetensors, tokenizer.json) into `path`; returns the HF model."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random init is tiny; widen it so the logits are not all ties
        for p in model.parameters():
            p.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer._tok.save(str(path / "tokenizer.json"))
    return model
