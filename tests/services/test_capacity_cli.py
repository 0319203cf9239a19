"""`kvserve capacity` (services/capacity.py): the calculator of tests/shared/test_capacity.py on
the command line, its JSON and table output, one-line errors, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvserve.services.cli import main
from kvserve.shared.capacity import PRESETS
from kvserve.shared.config import default_model_path

GiB = 1 << 30


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
