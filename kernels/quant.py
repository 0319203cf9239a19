"""Triton per-(token, head) KV quantization: `quantize_kv` / `dequantize_kv`, same semantics as
`kernels.reference` (symmetric, one float32 scale per row of head_dim values).

Invariants:
- `scale = max(amax / QMAX, 1e-8)` and `q = round(clamp(x / scale, -QMAX, QMAX))`, QMAX = 127 for
  int8 (round half to even, like `torch.round`) and 448 for float8_e4m3fn (round to the nearest
  e4m3 value, ties to even, like torch's cast). Divisions are IEEE round-to-nearest
  (`tl.math.div_rn`), so on CPU (TRITON_INTERPRET=1) and on CUDA `q` and `scale` are bit-identical
  to the reference.
- The rounding is done in float32 by the helpers below, so the final cast to int8/fp8 is exact on
  every backend: neither libdevice `rint` (missing under the interpreter) nor the interpreter's
  fp8 cast (which rounds ties away from zero and mishandles a mantissa carry) is relied upon.
- `quantize_rows` is the rule itself, a device function: `quantize_kv` applies it to rows it
  loads, `store_kv` to the rows it scatters into the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvserve.kernels.reference import FP8_E4M3_MAX, INT8_MAX, QUANTIZED_DTYPES

# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _round_half_even(x):
    """x: fp32 with |x| < 2**22 -> the nearest integer (ties to even), still fp32, keeping the
    sign of a zero result like torch.round (-0.3 and -0.0 -> -0.0, which e4m3 stores as 0x80)."""
    a = tl.abs(x)
    f = tl.floor(a)
    frac = a - f  # exact: |x| < 2**22
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    r = tl.where(up, f + 1.0, f)
    negative = x.to(tl.int32, bitcast=True) < 0  # the sign bit: true for -0.0 too
    return tl.where(negative, -r, r)


@triton.jit
def _round_to_e4m3(x):
    """x: fp32 in [-448, 448] -> the nearest float8_e4m3fn value (ties to even), still fp32.

    e4m3 keeps 3 mantissa bits: the spacing at |x| in [2**e, 2**(e+1)) is 2**(e-3), and below the
    smallest normal (2**-6) it is the subnormal step 2**-9. Scaling by powers of two is exact.
    """
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # unbiased exponent, floored at e4m3's min
    inv_step = ((127 + 3 - e) << 23).to(tl.float32, bitcast=True)  # 2**(3-e)
    step = ((127 - 3 + e) << 23).to(tl.float32, bitcast=True)  # 2**(e-3)
    return _round_half_even(x * inv_step) * step


@triton.jit
def quantize_rows(x, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    """x: [R, D] fp32 (masked lanes 0) -> (q [R, D] fp32 holding exact int8/e4m3 values,
    scale [R] fp32)."""
    amax = tl.max(tl.abs(x), axis=1)  # [R]
    scale = tl.maximum(tl.math.div_rn(amax, QMAX), 1e-8)  # [R]; an all-zero row gets 1e-8
    y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))  # [R, D]
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    q = _round_to_e4m3(y) if IS_FP8 else _round_half_even(y)
    return q, scale


@triton.jit
def _row_block(R, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's BLOCK_R rows of an [R, D] tensor: (row indices [BLOCK_R] int64, columns
    [BLOCK_D], row mask [BLOCK_R], element mask [BLOCK_R, BLOCK_D])."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    r_mask = rows < R
    mask = r_mask[:, None] & (cols[None, :] < D)  # [BLOCK_R, BLOCK_D]
    return rows.to(tl.int64), cols, r_mask, mask


@triton.jit
def _quantize_kernel(
    x_ptr,  # [R, D] float, row stride stride_x, unit column stride
    q_ptr,  # [R, D] int8 / fp8, contiguous
    scale_ptr,  # [R] fp32
    R,
    stride_x,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    rows64, cols, r_mask, mask = _row_block(R, D, BLOCK_R, BLOCK_D)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    q, scale = quantize_rows(x.to(tl.float32), QMAX, IS_FP8)
    tl.store(q_ptr + rows64[:, None] * D + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + rows64, scale, mask=r_mask)


@triton.jit
def _dequantize_kernel(
    q_ptr,  # [R, D] int8 / fp8, row stride stride_q, unit column stride
    scale_ptr,  # [R] fp32, contiguous
    out_ptr,  # [R, D] out dtype, contiguous
    R,
    stride_q,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows64, cols, r_mask, mask = _row_block(R, D, BLOCK_R, BLOCK_D)
    q = tl.load(q_ptr + rows64[:, None] * stride_q + cols[None, :], mask=mask, other=0.0)
    scale = tl.load(scale_ptr + rows64, mask=r_mask, other=0.0)  # [BLOCK_R]
    x = q.to(tl.float32) * scale[:, None]  # [BLOCK_R, BLOCK_D]
    tl.store(
        out_ptr + rows64[:, None] * D + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=mask
    )


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def qmax_of(dtype: torch.dtype) -> float:
    """The largest magnitude a quantized KV `dtype` stores: 127 (int8) or 448 (fp8 e4m3)."""
    if dtype == torch.int8:
        return INT8_MAX
    if dtype == torch.float8_e4m3fn:
        return FP8_E4M3_MAX
    raise ValueError(f"unsupported quantized KV dtype {dtype}")


def _row_tile(d: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D): a whole row per tile, about 4k elements per program."""
    block_d = triton.next_power_of_2(d)
    return max(1, 4096 // block_d), block_d


def launch_quantize(x2: torch.Tensor, q2: torch.Tensor, scale: torch.Tensor) -> None:
    """x2 [R, D] float (unit column stride) -> q2 [R, D] int8/fp8, scale [R] fp32 (contiguous)."""
    R, D = x2.shape
    assert x2.is_floating_point() and x2.dtype not in QUANTIZED_DTYPES
    assert x2.stride(1) == 1, "x rows must have unit column stride"
    assert q2.shape == (R, D) and q2.is_contiguous() and q2.dtype in QUANTIZED_DTYPES
    assert scale.shape == (R,) and scale.is_contiguous() and scale.dtype == torch.float32
    assert x2.device == q2.device == scale.device
    if R == 0:
        return
    block_r, block_d = _row_tile(D)
    _quantize_kernel[(triton.cdiv(R, block_r),)](
        x2, q2, scale, R, x2.stride(0),
        D=D, BLOCK_R=block_r, BLOCK_D=block_d,
        QMAX=qmax_of(q2.dtype), IS_FP8=q2.dtype == torch.float8_e4m3fn,
    )  # fmt: skip


def launch_dequantize(q2: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """q2 [R, D] int8/fp8 (unit column stride), scale [R] fp32 -> out [R, D] (contiguous)."""
    R, D = q2.shape
    assert q2.dtype in QUANTIZED_DTYPES and q2.stride(1) == 1
    assert scale.shape == (R,) and scale.is_contiguous() and scale.dtype == torch.float32
    assert out.shape == (R, D) and out.is_contiguous() and out.is_floating_point()
    assert q2.device == scale.device == out.device
    if R == 0:
        return
    block_r, block_d = _row_tile(D)
    _dequantize_kernel[(triton.cdiv(R, block_r),)](
        q2, scale, out, R, q2.stride(0), D=D, BLOCK_R=block_r, BLOCK_D=block_d
    )


# ---------------------------------------------------------------------------------------------
# Public functions (signatures of kernels.reference)
# ---------------------------------------------------------------------------------------------


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(token, head) quantization over the last (head_dim) axis.

    x: [..., head_dim] float -> (q: [..., head_dim] of `dtype`, scale: [...] float32)
    with x ~= q * scale[..., None]. Bit-identical to `reference.quantize_kv`.
    """
    qmax_of(dtype)  # rejects unsupported dtypes before any allocation
    lead, d = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, d)  # [R, d]; a view when possible
    if x2.shape[0] and x2.stride(1) != 1:
        x2 = x2.contiguous()
    q = torch.empty((*lead, d), dtype=dtype, device=x.device)  # [..., d]
    scale = torch.empty(lead, dtype=torch.float32, device=x.device)  # [...]
    launch_quantize(x2, q.view(-1, d), scale.view(-1))
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q: [..., head_dim] int8/fp8, scale: [...] float32 -> [..., head_dim] of `dtype`."""
    lead, d = q.shape[:-1], q.shape[-1]
    assert scale.shape == lead, f"scale {tuple(scale.shape)} != q's leading dims {tuple(lead)}"
    q2 = q.reshape(-1, d)  # [R, d]
    if q2.shape[0] and q2.stride(1) != 1:
        q2 = q2.contiguous()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)  # [..., d]
    launch_dequantize(q2, scale.reshape(-1).float().contiguous(), out.view(-1, d))
    return out
