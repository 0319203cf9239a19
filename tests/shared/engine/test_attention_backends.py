"""The engine through each attention backend, and with a quantized KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvserve.shared.config import CacheConfig, EngineConfig
from kvserve.shared.engine.engine import Engine
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.model.tiny_llama import save_tiny_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer) -> Path:  # type: ignore[no-untyped-def]
    """A 2-layer GQA Llama with random weights in HF layout (small enough for the interpreter)."""
    path = tmp_path_factory.mktemp("tiny-gqa")
    save_tiny_llama(path, tokenizer, num_kv_heads=2)
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
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
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
