"""The engine against what this machine can do: the machine's figures at the start of a run
(`Roofline`), those measured beside the decode probes' steps (`paired_figures`), and the ratios
`kvserve bench engine` prints (`roofline_ratios`):

  roofline_bB        = (weight + KV bytes) / bandwidth / engine step at batch B (1 and 8)
  linear_roofline_bB = weight bytes / bandwidth / the engine's linear kernels alone at batch B
  linear_share_b32   = bare linear time at batch 32 / engine step at batch 32
  flop_frac_b32      = 2 * params * 32 / engine step at batch 32 / matmul peak

All of them are CPU measurements: off the CPU (`--device cuda`) `absent_figures` stands for them.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, fields

import torch
from kvserve.services.bench.lib.decode_probe import PROBE_BATCHES, DecodeProbe
from kvserve.services.bench.lib.engine_timing import ArmResult, StepRecord
from kvserve.services.bench.lib.machine import (
    FP32_BYTES,
    LinearChain,
    llama_linear_shapes,
    measure_machine,
    num_params,
)
from kvserve.shared.config import ModelConfig
from kvserve.shared.engine.kv.cache import kv_bytes_per_token, resolve_kv_dtype


@dataclass(frozen=True)
class Roofline:
    bandwidth_gb_s: float
    matmul_gflop_s: float
    linear_params: int
    bare_linear_b1_ms: float
    bare_linear_b32_ms: float


# The keys of paired_figures and roofline_ratios.
PAIRED_KEYS = (
    "bandwidth_paired_b1_gb_s",
    "kernel_linear_b1_paired_ms",
    "bandwidth_paired_b8_gb_s",
    "kernel_linear_b8_paired_ms",
    "bare_linear_b32_paired_ms",
)
RATIO_KEYS = (
    "roofline_b1",
    "linear_roofline_b1",
    "roofline_b8",
    "linear_roofline_b8",
    "linear_share_b32",
    "flop_frac_b32",
)


@dataclass(frozen=True)
class EngineSide:
    """The engine's measurements: arm 1 (W1) and its steps, the three decode probes."""

    kvserve: ArmResult
    steps: list[StepRecord]
    b1: DecodeProbe
    b8: DecodeProbe
    b32: DecodeProbe
    weights: str  # --weights
    weight_bytes: int  # read per decode step by the engine's linear layers
    kv_dtype: str = "auto"  # --kv-dtype

    @property
    def probes(self) -> tuple[DecodeProbe, DecodeProbe, DecodeProbe]:
        return self.b1, self.b8, self.b32


def measure_roofline(chain: LinearChain, args: argparse.Namespace) -> Roofline:
    machine = measure_machine(args.bandwidth_mib << 20, args.matmul_size)
    return Roofline(
        machine.bandwidth_gb_s,
        machine.matmul_gflop_s,
        num_params(chain.shapes),
        chain.median_ms(PROBE_BATCHES[0], args.repeats),
        chain.median_ms(PROBE_BATCHES[1], args.repeats),
    )


def paired_figures(
    args: argparse.Namespace, b1: DecodeProbe, b8: DecodeProbe, b32: DecodeProbe
) -> dict[str, float]:
    """The machine figures measured beside the probes' steps: read bandwidth (best sample, as
    `memory_bandwidth_gb_s`), the engine's linear kernels alone at batch 1 and 8 and the bare
    chain at batch 32 (medians, as `median_ms`)."""
    nbytes = ((args.bandwidth_mib << 20) // FP32_BYTES) * FP32_BYTES
    return {
        "bandwidth_paired_b1_gb_s": nbytes / min(b1.paired_s["bandwidth"]) / 1e9,
        "kernel_linear_b1_paired_ms": statistics.median(b1.paired_s["kernel_linear"]) * 1e3,
        "bandwidth_paired_b8_gb_s": nbytes / min(b8.paired_s["bandwidth"]) / 1e9,
        "kernel_linear_b8_paired_ms": statistics.median(b8.paired_s["kernel_linear"]) * 1e3,
        "bare_linear_b32_paired_ms": statistics.median(b32.paired_s["bare_linear"]) * 1e3,
    }


def roofline_ratios(
    roof: Roofline,
    model: ModelConfig,
    side: EngineSide,
    paired: dict[str, float],
) -> dict[str, float]:
    """roofline_b1 and linear_share_b32 divide by the figures measured beside the steps (the
    read bandwidth of a shared machine drifts within minutes, so a figure taken at another
    time would not describe the steps); flop_frac_b32 by the matmul peak.
    linear_roofline_b1 is the engine's linear kernels alone against the same bandwidth: what
    roofline_b1 would be if a step did nothing but its projections. The weight bytes are those
    the engine's layers store (fp32 panels, or the file's quantized blocks); batch 8 likewise."""
    b32 = side.b32
    ratios = {}
    token_kv_bytes = kv_bytes_per_token(model, resolve_kv_dtype(side.kv_dtype, torch.float32))
    for probe in (side.b1, side.b8):
        b = probe.batch
        kv_bytes = probe.batch * probe.mean_context * token_kv_bytes
        bandwidth = paired[f"bandwidth_paired_b{b}_gb_s"] * 1e9
        ideal_s = (side.weight_bytes + kv_bytes) / bandwidth
        linear_ms = paired[f"kernel_linear_b{b}_paired_ms"]
        ratios[f"roofline_b{b}"] = ideal_s * 1e3 / probe.step_ms
        ratios[f"linear_roofline_b{b}"] = side.weight_bytes / bandwidth * 1e3 / linear_ms
    b32_flops = 2 * roof.linear_params * b32.batch / (b32.step_ms / 1e3)
    return {
        **ratios,
        "linear_share_b32": paired["bare_linear_b32_paired_ms"] / b32.step_ms,
        "flop_frac_b32": b32_flops / (roof.matmul_gflop_s * 1e9),
    }


def absent_figures(model: ModelConfig) -> dict[str, int | None]:
    """The Roofline's, paired_figures' and roofline_ratios' keys where they are not measured
    (off the CPU): None, all but the model's linear parameter count."""
    absent: dict[str, int | None] = dict.fromkeys(f.name for f in fields(Roofline))
    absent["linear_params"] = num_params(llama_linear_shapes(model))
    return {**absent, **dict.fromkeys(PAIRED_KEYS), **dict.fromkeys(RATIO_KEYS)}
