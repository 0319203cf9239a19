"""The engine through each attention backend, and with a quantized KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvserve.shared.config import CacheConfig, EngineConfig
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer) -> Path:  # type: ignore[no-untyped-def]
    """A 2-layer GQA Llama with random weights in HF layout (small enough for the interpreter)."""
    path = tmp_path_factory.mktemp("tiny-gqa")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer._tok.save(str(path / "tokenizer.json"))
    return path


def run(path: Path, backend: str, kv_dtype: str = "auto") -> list[list[int]]:
    engine = Engine(
        EngineConfig(
            model_path=str(path),
            attention_backend=backend,
            cache=CacheConfig(num_blocks=32, kv_dtype=kv_dtype),
        )
    )
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 33)]  # 1 partial, 2 full blocks
    out = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert engine.pool.num_free == engine.pool.num_blocks
    return [c[0] for c in out]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_triton_backend_matches_reference_tokens(tiny_model: Path, kv_dtype: str) -> None:
    pytest.importorskip("triton")
    assert run(tiny_model, "triton", kv_dtype) == run(tiny_model, "torch", kv_dtype)


def test_cpu_kernel_backend_matches_reference_tokens(tiny_model: Path) -> None:
    assert run(tiny_model, "cpu") == run(tiny_model, "torch")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_cache_stays_close(make_engine, tokenizer, kv_dtype: str) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(
        "The paged KV cache stores keys and values in fixed-size blocks so that memory is "
        "allocated on demand and shared between sequences that have a common prefix. " * 3
    )
    ref = torch.log_softmax(make_engine().score(ids), -1)
    quant = torch.log_softmax(make_engine(kv_dtype=kv_dtype).score(ids), -1)
    kld = (ref.exp() * (ref - quant)).sum(-1).mean().item()
    assert 0 < kld < 0.02
    agree = (ref.argmax(-1) == quant.argmax(-1)).float().mean().item()
    assert agree > 0.9
