"""What this machine can do, measured in the same run as a benchmark: memory read bandwidth, fp32
matmul FLOP/s, and the bare cost of a model's linear layers as plain chained `F.linear` calls.

The engine's numbers are judged against these: a decode step at batch 1 should take about the
time to read the weights (and the KV) once at this bandwidth; at batch 32 it should cost little
more than its linear layers alone. Every function here allocates its own tensors and frees them
on return; nothing is measured at import.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from kvserve.shared.config import ModelConfig

FP32_BYTES = 4

# (out_features, in_features) of one linear weight, as F.linear takes it.
Shape = tuple[int, int]


def _seconds(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """The fastest of `repeats` timed calls (for peaks: noise only ever adds time)."""
    return min(_seconds(fn, repeats, warmup))


def median_seconds(fn: Callable[[], object], repeats: int = 9, warmup: int = 1) -> float:
    """The median of `repeats` timed calls (for costs we compare with other medians)."""
    return statistics.median(_seconds(fn, repeats, warmup))


@torch.inference_mode()
def memory_bandwidth_gb_s(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: the best time to sum a float32 tensor of `size_bytes`."""
    x = torch.ones(size_bytes // FP32_BYTES, dtype=torch.float32)
    seconds = best_seconds(x.sum, repeats)
    return x.numel() * FP32_BYTES / seconds / 1e9


@torch.inference_mode()
def matmul_gflop_s(n: int = 2048, repeats: int = 5) -> float:
    """fp32 GFLOP/s of an n x n x n matmul (2 n^3 FLOPs), best of `repeats`."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    seconds = best_seconds(lambda: torch.mm(a, b), repeats)
    return 2 * n**3 / seconds / 1e9


def llama_linear_shapes(config: ModelConfig) -> list[Shape]:
    """The weights every sampled decode token multiplies, in forward order: per layer the fused
    qkv, o, fused gate_up and down projections, then the LM head."""
    h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    layer = [
        ((h + 2 * kvh) * d, hidden),  # qkv
        (hidden, h * d),  # o
        (2 * inter, hidden),  # gate_up
        (hidden, inter),  # down
    ]
    return layer * config.num_layers + [(config.vocab_size, hidden)]


def num_params(shapes: list[Shape]) -> int:
    return sum(out * inp for out, inp in shapes)


class LinearChain:
    """Fresh random fp32 weights of `shapes`, applied as chained F.linear calls: each input is
    the first in_features columns of the previous output (as the model splits qkv and gate_up).
    No norms, activations, attention or Python around them: the floor of a step's cost."""

    def __init__(self, shapes: list[Shape]) -> None:
        self.shapes = shapes
        self.weights = [torch.randn(out, inp) * 0.02 for out, inp in shapes]

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = F.linear(x[:, : w.shape[1]], w)  # [batch, out]
        return x

    @torch.inference_mode()
    def median_ms(self, batch: int, repeats: int = 9) -> float:
        """Median ms of `batch` rows through the whole chain."""
        x = torch.randn(batch, self.weights[0].shape[1])
        return median_seconds(lambda: self.forward(x), repeats) * 1e3


class KernelChain:
    """Linear layers of the engine's own kind (`llama.Linear`: the panel GEMM of
    kernels/cpu_linear.py, the quantized one of kernels/cpu_qlinear.py, or oneDNN where neither
    applies), chained as LinearChain chains its weights: what a decode step's projections cost
    with nothing else in the step. `of_model` takes a loaded model's own layers, in forward
    order."""

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers

    @classmethod
    def of_model(cls, model: Any) -> KernelChain:
        return cls([*model.linears(), model.lm_head])

    @property
    def weight_bytes(self) -> int:
        """The bytes of weights one pass reads, as the layers store them."""
        return sum(layer.weight_bytes for layer in self.layers)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x[:, : layer.in_features])
        return x


@dataclass(frozen=True)
class MachineProfile:
    bandwidth_gb_s: float
    matmul_gflop_s: float


def measure_machine(bandwidth_bytes: int = 1 << 30, matmul_n: int = 2048) -> MachineProfile:
    return MachineProfile(memory_bandwidth_gb_s(bandwidth_bytes), matmul_gflop_s(matmul_n))
