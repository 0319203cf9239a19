"""ops/gpu_check.sh, the GPU path's one prepared check: `--smoke` runs every step on the CPU
(Triton's interpreter, tiny sizes) so that the script cannot rot where no GPU is; here on a tiny
random Llama given as an HF directory without weights, so the random-weights step runs too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvserve.shared.model.tokenizer import KVTokenizer

from tests.shared.model.tiny_llama import save_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
STEPS = {"kernels", "engine", "bench_engine", "serve", "bench_serve", "gpu_bench"}


def gpu_check(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ROOT / "ops" / "gpu_check.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer where CUDA is absent")
def test_without_cuda_it_says_so_in_one_line(tmp_path: Path) -> None:
    run = gpu_check("--out", str(tmp_path))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "gpu_check: no CUDA device (--smoke runs the steps on the CPU)"
    ]


@pytest.mark.slow  # ~4 min: every step on the CPU (2-core AVX2 machine); 5+ on slower ones
@pytest.mark.timeout(1200)  # the check's own limit below, not the suite's 300 s default
def test_smoke_runs_every_step(tmp_path: Path, tokenizer: KVTokenizer) -> None:
    model = tmp_path / "tiny"
    save_tiny_llama(model, tokenizer, num_kv_heads=2)
    (model / "model.safetensors").unlink()  # config and tokenizer only: weights made up
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192  # the OpenAI suite expects the default's window
    config["initializer_range"] = 0.16  # peaked logits, as save_tiny_llama's weights have
    (model / "config.json").write_text(json.dumps(config))
    info = tokenizer.info
    template = {"chat_template": info.chat_template, "eos_token": info.eos_token}
    (model / "tokenizer_config.json").write_text(json.dumps(template))
    out = tmp_path / "out"
    run = gpu_check("--smoke", "--model", str(model), "--out", str(out))
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    failed = {k: v.get("log_tail") for k, v in summary["steps"].items() if not v["ok"]}
    assert run.returncode == 0 and failed == {}
    assert summary["random_weights"] and set(summary["steps"]) == STEPS
    steps = summary["steps"]
    assert steps["kernels"]["passed"] > 100 and "failed" not in steps["kernels"]
    assert steps["engine"]["passed"] >= 6 and steps["serve"]["passed"] >= 30
    assert steps["bench_engine"]["kvserve_tok_s"] > 0 and steps["bench_engine"]["hf_tok_s"] > 0
    assert steps["bench_serve"]["completed"] == 8 and steps["bench_serve"]["failed"] == 0
    assert steps["gpu_bench"]["checks_passed"] == steps["gpu_bench"]["checks"] > 0
    assert json.loads((out / "summary.json").read_text()) == summary
