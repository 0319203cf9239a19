"""The linear layers on the GGUF file's own blocks (`weights="file"`, the default where the
kernels exist): the same numbers as the fp32 expansion, bit for bit, in a quarter of the memory;
formats without a kernel are expanded and named; settings that cannot use the blocks refused."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from kvserve.kernels import cpu_qlinear
from kvserve.shared.config import EngineConfig
from kvserve.shared.engine.engine import Engine
from kvserve.shared.model.loader import LoadedWeights, load_weights
from kvserve.shared.model.quantized import QuantizedWeight
from kvserve.shared.sampling_params import SamplingParams

needs_kernels = pytest.mark.skipif(not cpu_qlinear.available(), reason="no C++ toolchain")
ALL = frozenset(cpu_qlinear.FORMATS)


@pytest.fixture(scope="module")
def file_weights(model_path: Path) -> LoadedWeights:
    return load_weights(model_path, torch.float32, keep=ALL)


def test_the_file_blocks_are_kept_and_expand_to_the_loaders_fp32(
    file_weights: LoadedWeights, weights: LoadedWeights
) -> None:
    kept = file_weights.quantized
    assert kept["model.embed_tokens.weight"] == "q8_0"
    assert kept["model.layers.0.self_attn.q_proj.weight"] == "q4_1"
    assert len(kept) == 1 + 7 * file_weights.config.num_layers
    assert file_weights.fingerprint == weights.fingerprint  # the same file, the same identity
    for name in (
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ):
        w = file_weights.weights[name]
        assert isinstance(w, QuantizedWeight)
        assert torch.equal(w.dequantize(), weights.weights[name])  # Q/K rows unpermuted too
    stored = sum(
        w.blocks.numel() for w in file_weights.weights.values() if isinstance(w, QuantizedWeight)
    )
    expanded = sum(weights.weights[n].numel() * 4 for n in kept)
    assert stored * 4 < expanded


def test_a_format_without_a_kernel_is_expanded_and_named(
    model_path: Path, weights: LoadedWeights, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.shared.model.loader"):
        loaded = load_weights(model_path, torch.float32, keep=frozenset({"q8_0"}))
    assert set(loaded.quantized.values()) == {"q8_0"}
    lines = [r.getMessage() for r in caplog.records if "no quantized kernel" in r.getMessage()]
    assert lines == ["GGUF tensor type Q4_1 has no quantized kernel: expanded to fp32"]
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(loaded.weights[name], weights.weights[name])  # type: ignore[arg-type]


@needs_kernels
def test_the_engine_on_the_file_blocks_gives_the_fp32_numbers(
    make_engine,
    file_weights: LoadedWeights,
    chat_prompt_ids,  # type: ignore[no-untyped-def]
) -> None:
    """`file` (the blocks alone) and `auto` (the blocks for steps of up to FAST_ROWS rows, the
    fp32 expansion above) both give the fp32 expansion's tokens and logits."""
    fp32 = make_engine()
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=7)
    prompts = chat_prompt_ids[:6]
    want = fp32.generate(prompts, params)  # decode steps of 6 rows: over FAST_ROWS
    few = fp32.generate(prompts[:2], params)
    seq = prompts[0] + want[0][0]
    for mode in ("file", "auto"):
        config = dataclasses.replace(fp32.config, weights=mode)
        engine = Engine(config, tokenizer=fp32.tokenizer, weights=file_weights)
        model = engine.runner.model
        down = model.layers[0].mlp.down
        assert down.qpanels is not None and model.lm_head.qpanels is not None
        assert (down.panels is None) == (mode == "file")  # auto keeps the expansion too
        assert down.quantized_for(1) and down.quantized_for(cpu_qlinear.FAST_ROWS)
        assert down.quantized_for(cpu_qlinear.FAST_ROWS + 1) == (mode == "file")
        assert model.decoder_weights(1) is not None  # the one-call decode step takes them
        assert engine.generate(prompts, params) == want, mode  # prefill, decode, sampling
        assert engine.generate(prompts[:2], params) == few, mode
        assert torch.equal(engine.score(seq), fp32.score(seq)), mode


@needs_kernels
def test_the_default_loads_the_file_blocks(model_path: Path) -> None:
    engine = Engine(EngineConfig(model_path=str(model_path)))
    assert engine.runner.model.embed_blocks is not None
    assert engine.runner.model.layers[0].mlp.down.qpanels is not None
    fp32 = Engine(EngineConfig(model_path=str(model_path), weights="fp32"))
    assert fp32.runner.model.embed_blocks is None
    assert fp32.runner.model.layers[0].mlp.down.qpanels is None
    assert engine.model_fingerprint == fp32.model_fingerprint  # the same K/V, shareable


def test_settings_that_cannot_use_the_blocks_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int4")
    with pytest.raises(ValueError, match="needs dtype float32"):
        EngineConfig(weights="file", dtype="bfloat16")
    with pytest.raises(ValueError, match="runs bfloat16 matmuls"):
        EngineConfig(weights="bf16", matmul_dtype="float32")
    assert EngineConfig(weights="bf16").resolved_matmul_dtype == "bfloat16"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a GGUF file"):
        Engine(EngineConfig(model_path=str(tmp_path), weights="file"))
