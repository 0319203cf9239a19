"""y = x @ W.T in fp32 on the CPU for W held in a GGUF file's own blocks (Q4_0, Q4_1, Q8_0).

A GGUF block holds 32 consecutive weights of one output row: an fp16 scale d (and, Q4_1, an
fp16 offset m) and 32 quants (4-bit: w = d q + m, Q4_0 w = d (q - 8); 8-bit: w = d q). `pack`
lays the blocks out as cpu_linear's column panels: per panel of NR output columns and per block
of 32 rows of k, the NR scales (and offsets) as fp16, then the quants row by row, NR to a row
(4-bit: one byte holds rows 2j and 2j + 1 of a column, low nibble first). The bytes per column
and block are the format's GGML type size (18, 20, 34), which names the format to the kernel.

The kernel turns each quant into its fp32 weight in registers (the file's own value, exactly as
the fp32 expansion holds it) and accumulates every output element as one lane's sequential sum
over k, as cpu_linear does: its result is bit-identical to cpu_linear over the dequantized
weight, for any number of rows, while it reads 4.5-8.5 bits per weight instead of 32. Up to
REG_ROWS rows dequantize in registers; more rows dequantize each panel once into a scratch
buffer and run cpu_linear's tiles on it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from kvserve.kernels import cpp_build, cpu_linear

QK = 32  # weights per block
# Rows up to which this kernel dequantizes in registers (REG_ROWS in the C++), and up to which
# it is faster than cpu_linear's fp32 panels: above, its cost is the fp32 tiles' plus the
# expansion of every panel (docs/benchmarks.md, file weights).
FAST_ROWS = 4
# format -> bytes per block of 32 weights (GGML's type sizes)
FORMATS = {"q4_0": 18, "q4_1": 20, "q8_0": 34}


def _extension() -> Any | None:
    return cpp_build.extension()


def available() -> bool:
    return _extension() is not None


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """GGML's 4-bit block quants [..., 16] (byte j: quant j low, j + 16 high) -> [..., 32]."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def pack(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """A GGUF tensor's blocks, uint8 [N, K / 32 * size] (one row of blocks per output row) ->
    panels [ceil(N / NR), K / 32, NR * size], zero-padded to whole panels (zero scales)."""
    size = FORMATS[fmt]
    n = blocks.shape[0]
    nb = blocks.shape[1] // size
    nr = cpu_linear.panel_width()
    panels = -(-n // nr)
    b = F.pad(blocks.view(n, nb, size), (0, 0, 0, 0, 0, panels * nr - n))
    b = b.view(panels, nr, nb, size).transpose(1, 2)  # [P, nb, NR, size]
    scales = 4 if fmt == "q4_1" else 2
    parts = [b[..., i : i + 2].reshape(panels, nb, 2 * nr) for i in range(0, scales, 2)]
    quants = b[..., scales:]  # [P, nb, NR, 16 or 32]
    if fmt != "q8_0":
        q = _nibbles(quants)  # [P, nb, NR, 32]: quant k of each column
        quants = q[..., 0::2] | (q[..., 1::2] << 4)  # byte j: rows 2j, 2j + 1
    parts.append(quants.transpose(2, 3).reshape(panels, nb, -1))  # rows of NR
    return torch.cat(parts, dim=2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor | None:
    """x [M, K] @ W.T for W packed by `pack`, or None where this input is not for the kernel
    (not fp32 on the CPU, no compiled kernel)."""
    ext = _extension()
    if ext is None or x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2:
        return None
    out: torch.Tensor = ext.qlinear(x.contiguous(), packed, out_features)
    return out
