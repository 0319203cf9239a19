"""The KV-cache capacity calculator (shared/capacity.py); its command line, `kvserve capacity`,
in tests/services/test_capacity_cli.py."""

from __future__ import annotations

import dataclasses

import pytest
from kvserve.shared.capacity import (
    PRESETS,
    capacity_report,
    fit_in_memory,
    get_preset,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_scale_bytes_per_token,
    mha_equivalent,
    parameter_count,
    parse_size,
    weights_bytes,
)

from tests.shared.model_configs import model_config

GiB = 1 << 30


# --- bytes per token and cache size -------------------------------------------------------------


def test_llama2_7b_fp16_bytes_per_token() -> None:
    cfg = PRESETS["llama-2-7b"]
    assert kv_bytes_per_token(cfg, "fp16") == 2 * 32 * 32 * 128 * 2 == 524_288
    assert kv_bytes_per_token(cfg, "bf16") == 524_288
    assert kv_bytes_per_token(cfg, "fp32") == 1_048_576
    # Agrees with ModelConfig's own formula for unquantized dtypes.
    assert cfg.kv_bytes_per_token(2) == 524_288


def test_llama3_8b_gqa_bytes_per_token() -> None:
    assert kv_bytes_per_token(PRESETS["llama-3-8b"], "fp16") == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_bytes_per_token(PRESETS["mistral-7b"], "bf16") == 131_072
    assert kv_bytes_per_token(PRESETS["llama-2-70b"], "bf16") == 2 * 80 * 8 * 128 * 2


def test_smollm2_bytes_per_token() -> None:
    cfg = PRESETS["smollm2-135m"]
    assert kv_bytes_per_token(cfg, "fp16") == 2 * 30 * 3 * 64 * 2 == 23_040
    assert kv_bytes_per_token(cfg, "fp32") == 46_080


def test_int8_and_fp8_include_float32_scales() -> None:
    cfg = PRESETS["smollm2-135m"]
    # One byte per element plus a float32 scale per (token, KV head) for K and V in each layer.
    scales = 2 * 30 * 3 * 4
    assert kv_scale_bytes_per_token(cfg, "int8") == scales == 720
    assert kv_scale_bytes_per_token(cfg, "bf16") == 0
    assert kv_bytes_per_token(cfg, "int8") == 2 * 30 * 3 * 64 * 1 + scales == 12_240
    assert kv_bytes_per_token(cfg, "fp8") == 12_240
    llama3 = PRESETS["llama-3-8b"]
    assert kv_bytes_per_token(llama3, "int8") == 65_536 + 2 * 32 * 8 * 4 == 67_584


def test_cache_bytes_formula() -> None:
    cfg = PRESETS["llama-2-7b"]
    # 2 * batch * seq_len * layers * kv_heads * head_dim * bytes
    assert kv_cache_bytes(cfg, "fp16", 8, 4096) == 2 * 8 * 4096 * 32 * 32 * 128 * 2 == 16 * GiB
    assert kv_cache_bytes(PRESETS["llama-3-8b"], "bf16", 1, 8192) == GiB
    smol = PRESETS["smollm2-135m"]
    assert kv_cache_bytes(smol, "int8", 3, 100) == 3 * 100 * (2 * 30 * 3 * 64 + 2 * 30 * 3 * 4)


def test_bad_arguments_raise() -> None:
    cfg = PRESETS["smollm2-135m"]
    with pytest.raises(ValueError, match="unknown KV dtype"):
        kv_bytes_per_token(cfg, "int4")
    with pytest.raises(ValueError):
        kv_cache_bytes(cfg, "fp16", 0, 10)
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("gpt-5")


# --- parameters and presets ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [
        # The published parameter counts of the checkpoints.
        ("llama-2-7b", 6_738_415_616),
        ("llama-2-70b", 68_976_648_192),
        ("llama-3-8b", 8_030_261_248),
        ("llama-3-70b", 70_553_706_496),
        ("mistral-7b", 7_241_732_096),
        ("smollm2-135m", 134_515_008),  # tied embeddings
    ],
)
def test_parameter_count(name: str, params: int) -> None:
    assert parameter_count(PRESETS[name]) == params


def test_weights_bytes() -> None:
    cfg = PRESETS["llama-3-8b"]
    assert weights_bytes(cfg, "bf16") == 2 * 8_030_261_248
    assert weights_bytes(cfg, "int8") == 8_030_261_248


# --- what fits ----------------------------------------------------------------------------------


def test_fit_plain() -> None:
    cfg = PRESETS["llama-2-7b"]  # 512 KiB per token at fp16
    fit = fit_in_memory(cfg, "fp16", 24 * GiB, seq_len=4096)
    assert fit.tokens == 24 * GiB // 524_288 == 49_152
    assert fit.sequences == 49_152 // 4096 == 12
    assert fit.weights_bytes == 0 and fit.available_bytes == 24 * GiB


def test_fit_not_a_multiple() -> None:
    cfg = PRESETS["smollm2-135m"]
    fit = fit_in_memory(cfg, "int8", 10**9, seq_len=1000)
    assert fit.tokens == 10**9 // 12_240 == 81_699
    assert fit.sequences == 10**9 // (1000 * 12_240) == 81


def test_fit_counts_whole_blocks() -> None:
    cfg = PRESETS["smollm2-135m"]
    memory = 100 * 16 * 23_040 + 23_040  # 100 blocks of 16 tokens and one spare token
    fit = fit_in_memory(cfg, "bf16", memory, seq_len=17, block_size=16)
    assert fit.num_blocks == 100
    assert fit.tokens == 1600
    assert fit.sequences == 50  # 17 tokens take 2 blocks
    plain = fit_in_memory(cfg, "bf16", memory, seq_len=17)
    assert plain.tokens == 1601 and plain.sequences == 94


def test_fit_minus_weights() -> None:
    cfg = PRESETS["llama-3-8b"]
    memory = 80 * GiB
    fit = fit_in_memory(cfg, "bf16", memory, seq_len=8192, weights_dtype="bf16")
    assert fit.weights_bytes == 2 * 8_030_261_248
    assert fit.available_bytes == memory - 2 * 8_030_261_248
    assert fit.tokens == fit.available_bytes // 131_072
    assert fit.sequences == fit.available_bytes // (8192 * 131_072)
    # 70B weights in bf16 do not fit on one 80 GB device: nothing is left for the cache.
    none = fit_in_memory(PRESETS["llama-3-70b"], "bf16", 80 * 10**9, 4096, weights_dtype="bf16")
    assert none.available_bytes < 0 and none.tokens == 0 and none.sequences == 0


# --- MHA comparison -----------------------------------------------------------------------------


def test_gqa_saving_ratio() -> None:
    llama3 = PRESETS["llama-3-8b"]
    report = capacity_report(llama3, "bf16", 1, 8192)
    assert report.mha_bytes_per_token == 524_288
    assert report.kv_saving == 4.0
    assert report.mha_cache_bytes == 4 * report.cache_bytes
    assert capacity_report(llama3, "int8", 1, 8192).kv_saving == 4.0  # scales scale too
    assert capacity_report(PRESETS["llama-2-70b"], "fp16", 1, 1).kv_saving == 8.0
    assert capacity_report(PRESETS["smollm2-135m"], "fp32", 1, 1).kv_saving == 3.0
    assert capacity_report(PRESETS["llama-2-7b"], "fp16", 1, 1).kv_saving == 1.0
    assert mha_equivalent(llama3).num_kv_heads == 32


def test_mqa_saving_ratio() -> None:
    mqa = model_config(
        num_layers=32,
        num_heads=32,
        num_kv_heads=1,
        head_dim=128,
        vocab_size=32000,
        intermediate_size=11008,
    )
    assert capacity_report(mqa, "bf16", 1, 1).kv_saving == 32.0


def test_report_is_frozen() -> None:
    report = capacity_report(PRESETS["llama-3-8b"], "bf16", 2, 10, memory_bytes=GiB)
    assert report.fit is not None
    for obj, name in ((report, "cache_bytes"), (report.fit, "tokens")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 0)


# --- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 2**30),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1048576", 1_048_576),
        ("1.5GiB", 3 * 2**29),
        ("24 gib", 24 * 2**30),
        ("2Gi", 2 * 2**30),
        ("4K", 4000),
        ("1TiB", 2**40),
        ("100B", 100),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "24XB", "1.5", "24 GiBs", "1e9", "0.1B"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)
