"""The linear layers on the GGUF file's own blocks (`weights="file"`, the default where the
kernels exist): the fp32 expansion's tokens and next-token distributions (KLD < 1e-4; the
4-bit layers compute on ~15-bit activations) in a fifth of the memory, a sequence's tokens
independent of its batch; formats without a kernel are expanded and named; settings that
cannot use the blocks refused."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import gguf
import pytest
import torch
from kvserve.kernels import cpu_linear, cpu_qlinear
from kvserve.shared.config import EngineConfig
from kvserve.shared.engine.engine import Engine
from kvserve.shared.model.loader import LoadedWeights, load_weights
from kvserve.shared.model.quantized import QuantizedWeight, Weight, expand
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.model.fidelity import teacher_forced
from tests.shared.model.k_quants import q4_k_blocks, q5_k_blocks, q6_k_blocks

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
def test_the_engine_on_the_file_blocks_stays_with_the_fp32_expansion(
    make_engine,
    file_weights: LoadedWeights,
    chat_prompt_ids,  # type: ignore[no-untyped-def]
) -> None:
    fp32 = make_engine()
    config = dataclasses.replace(fp32.config, weights="file")
    file = Engine(config, tokenizer=fp32.tokenizer, weights=file_weights)
    model = file.runner.model
    assert model.layers[0].mlp.down.int8_activations and model.int8_activations
    assert model.lm_head.int8_activations  # Q8_0 too
    assert model.decoder_weights is not None  # the one-call decode step takes them
    assert file.model_fingerprint != fp32.model_fingerprint  # other K/V: other store keys
    prompts = chat_prompt_ids[:4]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = fp32.generate(prompts, params)
    together = file.generate(prompts, params)  # prefill and decode in one batch
    alone = [file.generate([p], params)[0] for p in prompts]
    assert together == alone  # a row's numbers do not depend on the batch
    kl, agree = teacher_forced(fp32, file, prompts, [c[0] for c in want])  # int8 path ran
    assert kl < 1e-4
    assert agree >= 0.99


def engines_on(
    make_engine,
    loaded: LoadedWeights,
    blocks: dict[str, Weight],  # type: ignore[no-untyped-def]
) -> tuple[Engine, Engine]:
    """An engine on `blocks` (`weights="file"`) and one on their fp32 expansion."""
    base = make_engine()
    expanded: dict[str, Weight] = {name: expand(w) for name, w in blocks.items()}
    file = Engine(
        dataclasses.replace(base.config, weights="file"),
        tokenizer=base.tokenizer,
        weights=LoadedWeights(loaded.config, blocks, "blocks"),
    )
    fp32 = Engine(
        base.config,
        tokenizer=base.tokenizer,
        weights=LoadedWeights(loaded.config, expanded, "blocks-fp32"),
    )
    return file, fp32


@pytest.mark.slow  # the default run stays within its time on the slowest CPUs
@needs_kernels
def test_k_quant_blocks_run_on_the_kernels(
    make_engine,
    file_weights: LoadedWeights,
    chat_prompt_ids,  # type: ignore[no-untyped-def]
) -> None:
    """The k-quants of most GGUFs (Q4_K_M, Q5_K_M): the MLP's down projections (1,536 inputs,
    whole blocks of 256) as Q4_K, Q5_K and Q6_K blocks in turn compute on the 4-bit and 8-bit
    kernels, and the engine stays with the fp32 expansion of the same blocks, in prefill and in
    the one-call decode step."""
    blocks = dict(file_weights.weights)
    for i in range(file_weights.config.num_layers):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        w = expand(blocks[name]).numpy()
        fmt, encode = [("q4_k", q4_k_blocks), ("q5_k", q5_k_blocks), ("q6_k", q6_k_blocks)][i % 3]
        blocks[name] = QuantizedWeight(fmt, torch.from_numpy(encode(w)))
    file, fp32 = engines_on(make_engine, file_weights, blocks)
    for i, size in ((0, 148), (1, 276), (2, 274)):  # bytes per column and block (cpu_qlinear)
        down = file.runner.model.layers[i].mlp.down
        assert down.qpanels is not None and down.qpanels.shape[2] == size * cpu_linear.panel_width()
    assert fp32.runner.model.layers[0].mlp.down.qpanels is None
    prompts = chat_prompt_ids[:4]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = fp32.generate(prompts, params)
    together = file.generate(prompts, params)
    assert together == [file.generate([p], params)[0] for p in prompts]
    kl, agree = teacher_forced(fp32, file, prompts, [c[0] for c in want])
    assert kl < 1e-4
    assert agree >= 0.99


@pytest.mark.slow  # the default run stays within its time on the slowest CPUs
@needs_kernels
def test_a_fused_projection_of_two_formats_keeps_both(
    make_engine,
    file_weights: LoadedWeights,
    chat_prompt_ids,  # type: ignore[no-untyped-def]
) -> None:
    """Q4_K_M files store some layers' V projection in another format than Q and K: the fused
    QKV keeps each run of one format in its blocks (here Q and K re-encoded as Q5_0, V as Q5_1,
    by gguf), the one-call decode step takes the parts side by side, and the engine stays with
    the fp32 expansion."""
    blocks = dict(file_weights.weights)
    kind = gguf.GGMLQuantizationType
    for i in range(file_weights.config.num_layers):
        for proj, fmt in (("q", kind.Q5_0), ("k", kind.Q5_0), ("v", kind.Q5_1)):
            name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            raw = gguf.quants.quantize(expand(blocks[name]).numpy(), fmt)
            blocks[name] = QuantizedWeight(fmt.name.lower(), torch.from_numpy(raw))
    mixed, fp32 = engines_on(make_engine, file_weights, blocks)
    qkv = mixed.runner.model.layers[0].attn.qkv
    c = file_weights.config
    kv = c.num_kv_heads * c.head_dim
    assert [n for _, n in qkv.qparts] == [c.num_heads * c.head_dim + kv, kv]
    assert qkv.weight_bytes * 3 < fp32.runner.model.layers[0].attn.qkv.weight_bytes
    assert mixed.runner.model.decoder_weights is not None  # the one-call step takes the parts
    prompts = chat_prompt_ids[:4]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = fp32.generate(prompts, params)
    got = mixed.generate(prompts, params)
    assert got == [mixed.generate([p], params)[0] for p in prompts]
    mixed.runner.model.decode_in_cpp = False  # the same kernels called layer by layer
    assert mixed.generate(prompts, params) == got
    kl, agree = teacher_forced(fp32, mixed, prompts, [c[0] for c in want])
    assert kl < 1e-4
    assert agree >= 0.99


@needs_kernels
def test_the_default_loads_the_file_blocks(model_path: Path) -> None:
    engine = Engine(EngineConfig(model_path=str(model_path)))
    assert engine.runner.model.embed_blocks is not None
    assert engine.runner.model.layers[0].mlp.down.qpanels is not None
    fp32 = Engine(EngineConfig(model_path=str(model_path), weights="fp32"))
    assert fp32.runner.model.embed_blocks is None
    assert fp32.runner.model.layers[0].mlp.down.qpanels is None


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
