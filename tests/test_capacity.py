"""The KV-cache capacity calculator: shared/capacity.py and `kvserve capacity`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvserve.services.cli import main
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
from kvserve.shared.config import ModelConfig, default_model_path

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
    mqa = ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=1,
        head_dim=128,
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


# --- the command line ---------------------------------------------------------------------------


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["capacity", *argv, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_cli_json_preset(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(
        capsys, "--preset", "llama-3-8b", "--batch", "4", "--seq-len", "8192", "--memory", "24GiB"
    )
    assert out["model"]["num_kv_heads"] == 8
    assert out["model"]["attention"] == "GQA"
    assert out["model"]["parameter_count"] == 8_030_261_248
    assert out["batch"] == 4 and out["seq_len"] == 8192 and out["memory_bytes"] == 24 * GiB
    assert set(out["kv_dtypes"]) == {"fp32", "bf16", "int8", "fp8"}
    bf16 = out["kv_dtypes"]["bf16"]
    assert bf16["bytes_per_token"] == 131_072
    assert bf16["cache_bytes"] == 4 * 8192 * 131_072 == 4 * GiB
    assert bf16["mha_bytes_per_token"] == 524_288
    assert bf16["kv_saving"] == 4.0
    assert bf16["fit"]["tokens"] == 24 * GiB // 131_072 == 196_608
    assert bf16["fit"]["sequences"] == 24
    int8 = out["kv_dtypes"]["int8"]
    assert int8["bytes_per_token"] == 67_584 and int8["scale_bytes_per_token"] == 2048


def test_cli_weights_and_block_size(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(
        capsys,
        "--preset",
        "llama-2-7b",
        "--seq-len",
        "4096",
        "--memory",
        "80GB",
        "--weights-dtype",
        "fp16",
        "--block-size",
        "1",
    )
    assert out["weights_bytes"] == 2 * 6_738_415_616
    avail = 80 * 10**9 - 2 * 6_738_415_616
    assert out["available_bytes"] == avail
    assert out["kv_dtypes"]["bf16"]["fit"]["tokens"] == avail // 524_288


def test_cli_default_seq_len_is_max_positions(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(capsys, "--preset", "mistral-7b")
    assert out["seq_len"] == 32768
    assert out["block_size"] == 16 and out["memory_bytes"] == 2 * GiB


def test_cli_config_file_and_hf_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = {
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    by_config = _run_json(capsys, "--config", str(tmp_path / "config.json"), "--seq-len", "64")
    by_dir = _run_json(capsys, "--model", str(tmp_path), "--seq-len", "64")
    for out in (by_config, by_dir):
        assert out["kv_dtypes"]["bf16"]["bytes_per_token"] == 23_040
        assert out["model"]["parameter_count"] == 134_515_008


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["capacity", "--preset", "llama-2-7b", "--seq-len", "4096", "--memory", "24GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for dtype in ("fp32", "bf16", "int8", "fp8"):
        assert any(line.startswith(dtype) for line in out.splitlines())
    assert "524,288" in out and "49,152" in out
    assert "2 x 32 layers x 32 KV heads x 4 B" in out


def test_cli_list_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--list-presets"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    listed = _run_json(capsys, "--list-presets")
    assert listed["llama-2-70b"]["num_kv_heads"] == 8


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--preset", "gpt-5"], "--preset"),
        (["--preset", "llama-3-8b", "--batch", "0"], "--batch"),
        (["--preset", "llama-3-8b", "--batch", "-3"], "--batch"),
        (["--preset", "llama-3-8b", "--seq-len", "0"], "--seq-len"),
        (["--preset", "llama-3-8b", "--seq-len", "many"], "--seq-len"),
        (["--preset", "llama-3-8b", "--memory", "24XB"], "--memory"),
        (["--preset", "llama-3-8b", "--memory", "0"], "--memory"),
        (["--preset", "llama-3-8b", "--weights-dtype", "q4"], "--weights-dtype"),
        (["--preset", "llama-3-8b", "--block-size", "0"], "--block-size"),
        (["--model", "/nonexistent/model.gguf"], "--model"),
        (["--config", "/nonexistent/config.json"], "--config"),
    ],
)
def test_cli_bad_input(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("kvserve capacity: error: ")
    assert flag in lines[0]


def test_cli_bad_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert main(["capacity", "--config", str(bad)]) == 2
    bad.write_text(json.dumps({"hidden_size": 64}))
    assert main(["capacity", "--config", str(bad)]) == 2
    (tmp_path / "x.bin").write_bytes(b"")
    assert main(["capacity", "--model", str(tmp_path / "x.bin")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(e.startswith("kvserve capacity: error: ") for e in err)


@pytest.mark.parametrize("size", [24, 1000, 123_457, None])  # cut at a boundary; junk
def test_cli_unreadable_gguf(
    size: int | None, model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.gguf"
    with model_path.open("rb") as f:
        bad.write_bytes(f.read(size) if size else b"not a gguf file at all")
    assert main(["capacity", "--model", str(bad)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("kvserve capacity: error: --model: cannot read GGUF")


def test_cli_missing_default_model_says_how_to_fetch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    assert main(["capacity"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "kvserve fetch-model" in err[0]


@pytest.mark.skipif(not default_model_path().is_file(), reason="default model not fetched")
def test_cli_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(capsys, "--seq-len", "2048", "--memory", "1GiB")
    model = out["model"]
    assert (model["num_layers"], model["num_heads"], model["num_kv_heads"]) == (30, 9, 3)
    assert model["head_dim"] == 64 and model["tie_word_embeddings"] is True
    assert model["parameter_count"] == 134_515_008
    assert out["kv_dtypes"]["bf16"]["bytes_per_token"] == 23_040
    assert out["kv_dtypes"]["int8"]["bytes_per_token"] == 12_240
    assert out["kv_dtypes"]["bf16"]["kv_saving"] == 3.0
    assert out["kv_dtypes"]["bf16"]["fit"]["tokens"] == GiB // (16 * 23_040) * 16


def test_no_torch_import(model_path: Path) -> None:
    code = (
        "import sys, json\n"
        "import kvserve.shared.capacity\n"
        "from kvserve.services.cli import main\n"
        "assert main(['capacity', '--preset', 'llama-3-8b', '--json']) == 0\n"
        f"assert main(['capacity', '--model', {str(model_path)!r}, '--json']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
