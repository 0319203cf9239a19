"""`kvserve bench engine` end to end on a tiny workload: it runs, its last stdout line is the JSON
summary with every number, and it writes its files. Speed is not asserted: the machine is shared."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from kvserve.kernels import cpu_decode_step
from kvserve.kernels.cpu_decode_step import LayerSeconds
from kvserve.services.bench.engine import build_summary
from kvserve.services.bench.engine_report import print_report
from kvserve.services.bench.lib.decode_probe import DecodeProbe
from kvserve.services.bench.lib.engine_timing import ArmResult
from kvserve.services.bench.lib.machine import llama_linear_shapes, num_params
from kvserve.services.bench.lib.roofline import (
    EngineSide,
    Roofline,
    paired_figures,
    roofline_ratios,
)
from kvserve.services.bench.workloads.batch import WorkloadSpec
from kvserve.services.cli import main

from tests.services.bench.workloads.test_batch import WORKLOAD

MEASURED_KEYS = (
    "kvserve_tok_s",
    "roofline_b1",
    "linear_share_b32",
    "flop_frac_b32",
    "bandwidth_gb_s",
    "matmul_gflop_s",
    "bare_linear_b1_ms",
    "bare_linear_b32_ms",
    "engine_step_b1_ms",
    "engine_step_b32_ms",
    "bandwidth_paired_b1_gb_s",
    "kernel_linear_b1_paired_ms",
    "bare_linear_b32_paired_ms",
    "linear_roofline_b1",
    "engine_step_b8_ms",
    "roofline_b8",
    "linear_roofline_b8",
)
HF_KEYS = ("hf_tok_s", "ratio")
# Tiny and single-threaded: two threads on a busy two-core machine stall on each other.
TINY_ARGS = [
    "--threads", "1",
    "--probe-context", "4",
    "--probe-steps", "2",
    "--repeats", "1",
    "--bandwidth-mib", "64",
    "--matmul-size", "256",
]  # fmt: skip


def workload_args() -> list[str]:
    return [a for k, v in WORKLOAD.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def run_bench(extra: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    rc = main(["bench", "engine", *workload_args(), *TINY_ARGS, *extra])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary: dict[str, object] = json.loads(last)
    return summary


def assert_positive(summary: dict[str, object], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = summary[key]
        assert isinstance(value, float) and value > 0, (key, value)


@pytest.mark.slow  # ~14 s; a benchmark's smoke run (2-core AVX2 machine)
def test_bench_engine_without_hf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "engine.png"
    summary = run_bench(["--skip-hf", "--out", str(tmp_path), "--plot", str(plot)], capsys)
    assert_positive(summary, MEASURED_KEYS)
    assert {k: summary[k] for k in WORKLOAD} == WORKLOAD
    assert summary["kvserve_tokens"] == 8 + 7 + 7 + 6  # the seed-0 targets
    assert summary["hf_tok_s"] is None and summary["ratio"] is None
    # The step ratios divide by the machine figures measured beside the probes' steps.
    share = summary["bare_linear_b32_paired_ms"] / summary["engine_step_b32_ms"]  # type: ignore[operator]
    assert summary["linear_share_b32"] == pytest.approx(share)
    saved = json.loads((tmp_path / "engine.json").read_text())
    assert saved["summary"] == summary
    assert len(saved["steps"]) == summary["kvserve_steps"]
    assert plot.stat().st_size > 0
    # The probes' steps ran their layers as the one C++ call where the kernels are built.
    parts = [summary[f"engine_{p}_b{b}_ms"] for p in LayerSeconds._fields for b in (1, 8, 32)]
    parts += [summary[f"engine_{p}_b{b}_ms"] for p in ("lm_head", "host") for b in (1, 8, 32)]
    if cpu_decode_step.applies(32, 64):
        assert all(isinstance(v, float) and v > 0 for v in parts), parts
    else:
        assert parts == [None] * len(parts)


@pytest.mark.slow
def test_bench_engine_with_hf_arm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = run_bench(["--hf-batch-size", "2", "--out", str(tmp_path)], capsys)
    assert_positive(summary, MEASURED_KEYS + HF_KEYS)
    # HF generates each batch's longest target for every row; only the targets count.
    assert summary["hf_useful_tokens"] == summary["kvserve_tokens"]
    assert summary["hf_generated_tokens"] >= summary["hf_useful_tokens"]  # type: ignore[operator]


def test_step_ratios_use_the_figures_paired_with_the_steps(weights) -> None:  # type: ignore[no-untyped-def]
    """Bandwidth from the fastest paired sample (as the machine line's best-of), the bare chain
    from the median paired run; the start-of-run figures only feed flop_frac_b32."""
    model_config = weights.config
    args = argparse.Namespace(bandwidth_mib=1)
    b1 = DecodeProbe(
        1,
        20.0,
        100.0,
        {"bandwidth": (0.004, 0.001, 0.002), "kernel_linear": (0.018, 0.016, 0.012)},
    )
    b8 = DecodeProbe(
        8, 40.0, 50.0, {"bandwidth": (0.002, 0.002), "kernel_linear": (0.020, 0.030, 0.025)}
    )
    b32 = DecodeProbe(32, 50.0, 100.0, {"bare_linear": (0.030, 0.040, 0.010)})
    paired = paired_figures(args, b1, b8, b32)
    assert paired["bandwidth_paired_b1_gb_s"] == pytest.approx((1 << 20) / 0.001 / 1e9)
    assert paired["kernel_linear_b1_paired_ms"] == pytest.approx(16.0)
    assert paired["kernel_linear_b8_paired_ms"] == pytest.approx(25.0)
    assert paired["bare_linear_b32_paired_ms"] == pytest.approx(30.0)
    roof = Roofline(999.0, 100.0, 1_000_000, 1.0, 1.0)  # start-of-run figures, unused here
    # The weight bytes are those the engine's layers store (here a quarter of fp32's).
    side = EngineSide(ArmResult("kvserve", 1.0, 1, 1), [], b1, b8, b32, "file", 1_000_000)
    ratios = roofline_ratios(roof, model_config, side, paired)
    assert ratios["linear_share_b32"] == pytest.approx(30.0 / 50.0)
    kv = 100.0 * model_config.kv_bytes_per_token(4)
    want_b1 = (1_000_000 + kv) / (paired["bandwidth_paired_b1_gb_s"] * 1e9) * 1e3 / 20.0
    assert ratios["roofline_b1"] == pytest.approx(want_b1)
    ideal_linear_ms = 1_000_000 / (paired["bandwidth_paired_b1_gb_s"] * 1e9) * 1e3
    assert ratios["linear_roofline_b1"] == pytest.approx(ideal_linear_ms / 16.0)
    bandwidth_b8 = paired["bandwidth_paired_b8_gb_s"] * 1e9
    kv8 = 8 * 50.0 * model_config.kv_bytes_per_token(4)
    assert ratios["roofline_b8"] == pytest.approx((1_000_000 + kv8) / bandwidth_b8 * 1e3 / 40.0)


# The summary's figures that describe the CPU: absent (None) off it.
CPU_ONLY_KEYS = (
    *(k for k in MEASURED_KEYS if k != "kvserve_tok_s" and not k.startswith("engine_step_")),
    "threads",
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_a_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", *workload_args(), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvserve bench: error: --device cuda: CUDA is not available here"]


def test_unknown_device_is_a_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", *workload_args(), "--device", "nonsense"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvserve bench: error: --device must be cpu or cuda[:N], got 'nonsense'"]


def test_summary_off_the_cpu_reports_the_cpu_figures_absent(  # type: ignore[no-untyped-def]
    weights, capsys: pytest.CaptureFixture[str]
) -> None:
    """Off the CPU the summary has the CPU run's keys (and the device), the CPU's figures None,
    and the report prints them as "-"."""
    spec = WorkloadSpec(**WORKLOAD)
    args = argparse.Namespace(
        device="cpu", hf_batch_size=2, threads=1, probe_context=4, probe_steps=2, bandwidth_mib=1
    )
    b1 = DecodeProbe(1, 2.0, 5.0, {"bandwidth": (0.001,), "kernel_linear": (0.001,)})
    b8 = DecodeProbe(8, 3.0, 5.0, {"bandwidth": (0.001,), "kernel_linear": (0.001,)})
    b32 = DecodeProbe(32, 4.0, 5.0, {"bare_linear": (0.001,)})
    side = EngineSide(ArmResult("kvserve", 1.0, 28, 28), [], b1, b8, b32, "fp32", 1_000_000)
    hf = ArmResult("hf", 2.0, 28, 32)
    roof = Roofline(10.0, 100.0, num_params(llama_linear_shapes(weights.config)), 1.0, 1.0)
    on_cpu = build_summary(spec, args, roof, weights.config, side, hf)
    gpu_side = EngineSide(
        side.kvserve, [], *(DecodeProbe(p.batch, p.step_ms, 5.0) for p in side.probes), "fp32", 1
    )
    args.device = "cuda"
    off_cpu = build_summary(spec, args, None, weights.config, gpu_side, hf)
    assert "device" not in on_cpu
    assert set(off_cpu) == set(on_cpu) | {"device"}
    assert off_cpu["device"] == "cuda"
    assert off_cpu["linear_params"] == on_cpu["linear_params"]
    assert off_cpu["ratio"] == on_cpu["ratio"] == 2.0
    for key in CPU_ONLY_KEYS:
        assert on_cpu[key] is not None and off_cpu[key] is None, key
    capsys.readouterr()
    print_report(off_cpu)
    out = capsys.readouterr().out
    assert "threads -, device cuda" in out
    assert "read bandwidth - GB/s" in out and "flop_frac_b32 = -" in out
    assert "roofline_b1 = n/a" in out and "ratio kvserve/hf = 2.000" in out
    assert json.loads(out.strip().splitlines()[-1]) == off_cpu


@pytest.mark.gpu
@pytest.mark.slow  # the HF arm loads the model too; not timed on a GPU yet
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_engine_on_cuda(  # type: ignore[no-untyped-def]
    model_path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Runs on a GPU machine only (`-m gpu`): both arms of a tiny W1 on the GPU; the CPU's
    figures absent (None), the decode probes' steps measured."""
    args = ["--model", str(model_path), "--device", "cuda", "--hf-batch-size", "2"]
    summary = run_bench([*args, "--out", str(tmp_path)], capsys)  # 4 requests (WORKLOAD)
    assert summary["device"] == "cuda"
    assert_positive(summary, ("kvserve_tok_s", "engine_step_b1_ms", "engine_step_b32_ms"))
    assert_positive(summary, HF_KEYS)
    assert summary["hf_useful_tokens"] == summary["kvserve_tokens"] == 8 + 7 + 7 + 6
    for key in CPU_ONLY_KEYS:
        assert summary[key] is None, key
    assert json.loads((tmp_path / "engine.json").read_text())["summary"] == summary
