"""y = x @ W.T on the CPU for W held in a GGUF file's own blocks (Q4_0, Q4_1, Q8_0).

A GGUF block holds 32 consecutive weights of one output row: an fp16 scale d (and, Q4_1, an
fp16 offset m) and 32 quants (4-bit: w = d q + m, Q4_0 w = d (q - 8); 8-bit: w = d q). `pack`
lays the blocks out as cpu_linear's column panels, per panel of NR output columns and per block
of 32 rows of k: the NR scales (and offsets) as fp16, then the quants.

- 4-bit (Q4_0 packed as Q4_1 with m = -8 d, exact in fp16): the quants as 4 groups of NR x 4
  bytes, byte j of column c in group g holding rows 4g + j (low nibble) and 16 + 4g + j (high).
  Each row of x is quantized per block of 32 into two int8 terms, x ~ d (q + r / 256) (d =
  max|x| / 127; q and r rounded to nearest even), and each block's 256 dot(q_w, q) + dot(q_w, r)
  is summed exactly in int32 by the CPU's byte dot products (AVX512-VNNI / AVX-VNNI `dpbusd`,
  else `maddubs` into int16 lanes, widened once per block): y = sum over blocks of
  d_w d / 256 (that sum) + m_w d / 256 (256 sum(q) + sum(r)). The activations are ~15-bit, so
  the results are within ~1e-5 of the fp32 expansion's, not equal (docs/benchmarks.md, file
  weights). Without VNNI, calls of many rows take a float path that computes the same block
  sums with FMAs on integer-valued floats (faster where maddubs runs at half the FMA's rate):
  the same results bit for bit.
- Q8_0: the quants as 16 pairs of rows of the block, NR columns x 2 bytes each, widened to int16
  and multiplied with the same activations as one int16 term, 256 q + r, in pairs (`madd`, or
  VNNI's `dpwssd`): y = sum over blocks of d_w d / 256 (sum of q_w (256 q + r)), each block's
  sum exact in int32.

A row's result does not depend on the other rows in the call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from kvserve.kernels import cpp_build, cpu_linear

QK = 32  # weights per block
# format -> bytes per block of 32 weights in the file (GGML's type sizes)
FORMATS = {"q4_0": 18, "q4_1": 20, "q8_0": 34}


def _extension() -> Any | None:
    return cpp_build.extension()


def available() -> bool:
    return _extension() is not None


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """GGML's 4-bit block quants [..., 16] (byte j: quant j low, j + 16 high) -> [..., 32]."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _scales(b: torch.Tensor, fmt: str) -> list[torch.Tensor]:
    """The fp16 scale bytes of blocks [..., size]: [d], or [d, m] for the 4-bit formats."""
    d = b[..., 0:2]
    if fmt == "q8_0":
        return [d]
    if fmt == "q4_1":
        return [d, b[..., 2:4]]
    m = (d.contiguous().view(torch.float16) * -8).view(torch.uint8)  # Q4_0: d (q - 8)
    return [d, m]


def pack(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """A GGUF tensor's blocks, uint8 [N, K / 32 * size] (one row of blocks per output row) ->
    panels [ceil(N / NR), K / 32, NR * packed size], zero-padded to whole panels (zero scales)."""
    size = FORMATS[fmt]
    n = blocks.shape[0]
    nb = blocks.shape[1] // size
    nr = cpu_linear.panel_width()
    panels = -(-n // nr)
    b = F.pad(blocks.view(n, nb, size), (0, 0, 0, 0, 0, panels * nr - n))
    b = b.view(panels, nr, nb, size).transpose(1, 2)  # [P, nb, NR, size]
    parts = [s.reshape(panels, nb, 2 * nr) for s in _scales(b, fmt)]
    if fmt == "q8_0":  # [P, nb, 16, NR, 2]: rows 2p and 2p + 1 of the block, per column
        quants = b[..., 2:].reshape(panels, nb, nr, 16, 2).transpose(2, 3)
    else:
        q = _nibbles(b[..., size - 16 :]).view(panels, nb, nr, 2, 4, 4)  # [.., half, g, j]
        quants = (q[..., 0, :, :] | (q[..., 1, :, :] << 4)).transpose(2, 3)  # [P, nb, g, NR, j]
    parts.append(quants.reshape(panels, nb, -1))
    return torch.cat(parts, dim=2).contiguous()


def linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, float_rows: int | None = None
) -> torch.Tensor | None:
    """x [M, K] @ W.T for W packed by `pack`, or None where this input is not for the kernel
    (not fp32 on the CPU, no compiled kernel). `float_rows` (tests): rows from which the 4-bit
    formats take the float path (-1: never); by default the machine's choice."""
    ext = _extension()
    if ext is None or x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2:
        return None
    if float_rows is None:
        out: torch.Tensor = ext.qlinear(x.contiguous(), packed, out_features)
    else:
        out = ext.qlinear(x.contiguous(), packed, out_features, float_rows)
    return out
