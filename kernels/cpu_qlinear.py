"""y = x @ W.T on the CPU for W held in a GGUF file's own blocks (Q4_0/1, Q5_0/1, Q8_0, and
the k-quants Q4_K, Q5_K, Q6_K).

A GGUF block holds 32 consecutive weights of one output row: an fp16 scale d (and, Q4_1, an
fp16 offset m) and 32 quants (4-bit: w = d q + m, Q4_0 w = d (q - 8); 5-bit: the same with a
fifth bit per weight, Q5_0 w = d (q - 16); 8-bit: w = d q). A Q4_K (Q5_K) block holds 256:
eight such sub-blocks of 32 whose d and m are products of the block's fp16 scales and each
sub-block's 6-bit ones (w = d sc q - dmin mn, in fp32); a Q6_K block 256 6-bit
quants in sixteen sub-blocks of 16, each scaled by d sc (fp16 d, int8 sc). `pack` lays the
blocks out as cpu_linear's column panels, per panel of NR output columns and per block of k
(32 rows, 256 for the k-quants): the NR numbers of each of the block's heads (scales, offsets,
sub-block scales as bytes), then the quants; the kernels form the k-quants' sub-block scales
as gguf does (exact fp32 products).

- 4-bit (Q4_0 packed as Q4_1 with m = -8 d, exact in fp16; Q4_K's sub-blocks): the quants as
  4 groups of NR x 4 bytes, byte j of column c in group g holding rows 4g + j (low nibble) and
  16 + 4g + j (high).
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
  sum exact in int32. The 5-bit formats and Q6_K the same way, their quants widened to int8
  (Q5_0 less 16, Q6_K less 32), each (sub-)block's sum scaled by its own d (Q6_K: d sc per 16
  weights), plus, with an offset (Q5_1, Q5_K), m d / 256 (256 sum(q) + sum(r)) as in 4-bit.

A row's result does not depend on the other rows in the call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from kvserve.kernels import cpp_build, cpu_linear

QK = 32  # weights per block of the kernels
# format -> (weights, bytes) per block in the file (GGML's block and type sizes)
FORMATS = {
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q8_0": (32, 34),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
}
EIGHT_BIT = ("q8_0", "q5_0", "q5_1", "q5_k", "q6_k")  # int8 quants in pairs of rows


def _extension() -> Any | None:
    return cpp_build.extension()


def available() -> bool:
    return _extension() is not None


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """GGML's 4-bit block quants [..., 16] (byte j: quant j low, j + 16 high) -> [..., 32]."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _q4_k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes [..., 12] -> its 8 sub-blocks' 6-bit scales and mins [..., 8]."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q6_k(b: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Q6_K blocks [n, ns, 210] (128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales of
    sub-blocks of 16, fp16 d; w = d sc (q - 32)) -> the heads (d, then each sc) and the quants
    q - 32 as int8 bytes [n, ns * 8, 32]."""
    n = b.shape[0]
    ql = b[..., :128].reshape(n, -1, 2, 1, 64)
    ql = torch.cat((ql & 0x0F, ql >> 4), dim=3).reshape(n, -1, 256)  # gguf's weight order
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
    qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(n, -1, 256)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).to(torch.int8).view(torch.uint8)
    sc = b[..., 192:208]
    return [b[..., 208:210], *(sc[..., j : j + 1] for j in range(16))], q.reshape(n, -1, 32)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> their bits [..., 8, n]: bit i of every byte in row i."""
    return (b.unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1


def _layout(blocks: torch.Tensor, fmt: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A GGUF tensor's blocks [n, nb, bytes] as the kernels keep them: per block (of 32, or of
    256 for the k-quants) its heads, each [n, nb, width] (one number per column: fp16 scales
    and offsets, the k-quants' sub-block scales as bytes), and the quants of its blocks of 32
    [n, K / 32, 32] (4-bit values, or int8 bytes)."""
    n = blocks.shape[0]
    size = FORMATS[fmt][1]
    b = blocks.view(n, -1, size)
    if fmt == "q8_0":
        return [b[..., 0:2]], b[..., 2:]
    if fmt == "q6_k":
        return _q6_k(b)
    if fmt in ("q5_0", "q5_1"):  # d (, m) (fp16), 32 fifth bits (little-endian), 16 bytes
        lead = size - 20
        high = _bits(b[..., lead : lead + 4]).transpose(-1, -2).reshape(n, -1, 32)  # weight i
        q = _nibbles(b[..., lead + 4 :]) | (high << 4)
        if fmt == "q5_0":  # d (q - 16), as Q8_0
            return [b[..., 0:2]], (q.to(torch.int8) - 16).view(torch.uint8)
        return [b[..., 0:2], b[..., 2:4]], q
    if fmt in ("q4_k", "q5_k"):  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, quants
        sc, mn = _q4_k_scale_min(b[..., 4:16])
        qs = b[..., size - 128 :].reshape(n, -1, 4, 1, 32)  # sub-blocks 2j (low), 2j + 1 (high)
        q = torch.cat((qs & 0x0F, qs >> 4), dim=3).reshape(n, -1, 32)
        if fmt == "q5_k":  # 32 bytes: bit j of byte l is weight l's fifth bit in sub-block j
            q = (q.view(n, -1, 8, 32) | (_bits(b[..., 16:48]) << 4)).reshape(n, -1, 32)
        bytes_ = [t[..., j : j + 1] for t in (sc, mn) for j in range(8)]
        return [b[..., 0:2], b[..., 2:4], *bytes_], q
    d = b[..., 0:2]
    if fmt == "q4_1":
        m = b[..., 2:4]
    else:  # Q4_0: d (q - 8)
        m = (d.contiguous().view(torch.float16) * -8).view(torch.uint8)
    return [d, m], _nibbles(b[..., size - 16 :])


def pack(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """A GGUF tensor's blocks, uint8 [N, K / weights * size] (one row of blocks per output row)
    -> panels [ceil(N / NR), K / weights, NR * packed size], zero-padded to whole panels (zero
    scales): per block, each head's NR numbers, then the quants of its blocks of 32. Packed
    sizes per column and block: Q4_0 and Q4_1 20 (fp16 d, m, 16 bytes of quants); Q8_0 and
    Q5_0 34 (fp16 d, 32 int8 quants, Q5_0's less 16); Q5_1 36 (fp16 d, m, 32 quants as bytes);
    Q4_K 148 (fp16 d, dmin, 8 + 8 bytes of sub-block sc, mn: the file's 144 unpacked); Q5_K
    276 (the same with 256 quants as bytes); Q6_K 274 (fp16 d, 16 int8 sc, 256 int8 quants
    less 32: its 210 with the quants widened)."""
    heads, quants = _layout(blocks, fmt)
    n, nq = quants.shape[:2]
    nb = heads[0].shape[1]
    nr = cpu_linear.panel_width()
    panels = -(-n // nr)

    def panel_major(t: torch.Tensor) -> torch.Tensor:  # [n, m, ...] -> [P, m, NR, ...]
        t = F.pad(t, (0, 0, 0, 0, 0, panels * nr - n))
        return t.view(panels, nr, t.shape[1], -1).transpose(1, 2)

    parts = [panel_major(h).reshape(panels, nb, -1) for h in heads]
    if fmt in EIGHT_BIT:  # [P, nq, 16, NR, 2]: rows 2p and 2p + 1 of the block, per column
        packed = panel_major(quants).reshape(panels, nq, nr, 16, 2).transpose(2, 3)
    else:
        q = panel_major(quants).reshape(panels, nq, nr, 2, 4, 4)  # [.., half, g, j]
        packed = (q[..., 0, :, :] | (q[..., 1, :, :] << 4)).transpose(2, 3)  # [P, nq, g, NR, j]
    parts.append(packed.reshape(panels, nb, -1))
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
