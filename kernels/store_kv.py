"""Triton `store_kv`: scatter a step's new K/V into the paged cache, quantizing on the way.

Invariants:
- Token i's K/V (all KV heads) goes to slot `slot_mapping[i] = block_id * block_size + offset`,
  i.e. `k_cache[block_id, offset]`; nothing else in the cache is written.
- Unquantized cache: the values are cast to the cache dtype. Quantized cache (int8 / fp8 e4m3):
  every (token, head) row gets its own float32 scale, written to `k_scale` / `v_scale` at the same
  slot; `q` and `scale` are bit-identical to `reference.quantize_kv` (see `kernels.quant`).
- A negative slot is skipped (a padding token); the reference rejects it. Duplicate slots in one
  call are a caller error (which write wins is unspecified, as with `index_copy_`).
- Work unit: a (token, head) row of head_dim values (the quantization unit); one program takes
  BLOCK_R consecutive rows (token-major), about 4k values of K and as many of V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvserve.kernels.quant import qmax_of, quantize_rows
from kvserve.kernels.reference import QUANTIZED_DTYPES, check_cache

# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_rows(
    src_ptr,  # [T, kvh, d] new K or V
    cache_ptr,  # [nb, bs, kvh, d]
    scale_ptr,  # [nb, bs, kvh] fp32 (written only when QUANTIZED)
    token,  # [BLOCK_R] int64
    head,  # [BLOCK_R] int64
    block_id,  # [BLOCK_R] int64
    offset,  # [BLOCK_R] int64
    dims,  # [BLOCK_D]
    r_mask,  # [BLOCK_R]
    mask,  # [BLOCK_R, BLOCK_D]
    stride_st,
    stride_sh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_xb,
    stride_xo,
    stride_xh,
    QUANTIZED: tl.constexpr,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    src = src_ptr + token * stride_st + head * stride_sh  # [BLOCK_R] row starts
    x = tl.load(src[:, None] + dims[None, :], mask=mask, other=0.0)  # [BLOCK_R, BLOCK_D]
    dst = cache_ptr + block_id * stride_cb + offset * stride_co + head * stride_ch  # [BLOCK_R]
    if QUANTIZED:
        q, scale = quantize_rows(x.to(tl.float32), QMAX, IS_FP8)  # [BLOCK_R, BLOCK_D], [BLOCK_R]
        tl.store(dst[:, None] + dims[None, :], q.to(cache_ptr.dtype.element_ty), mask=mask)
        s_dst = scale_ptr + block_id * stride_xb + offset * stride_xo + head * stride_xh
        tl.store(s_dst, scale, mask=r_mask)
    else:
        tl.store(dst[:, None] + dims[None, :], x.to(cache_ptr.dtype.element_ty), mask=mask)


# Long for a function: a Triton kernel takes every pointer, stride and constant as a parameter
# of its own (Triton has no structs).
@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, kvh, d]
    value_ptr,  # [T, kvh, d]
    k_cache_ptr,  # [nb, bs, kvh, d]
    v_cache_ptr,  # [nb, bs, kvh, d]
    k_scale_ptr,  # [nb, bs, kvh] fp32 (dummy when not QUANTIZED)
    v_scale_ptr,
    slot_mapping_ptr,  # [T] int64 / int32
    num_rows,  # T * kvh
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # k_cache and v_cache share strides (asserted by the launcher)
    stride_co,
    stride_ch,
    stride_xb,  # k_scale and v_scale share strides
    stride_xo,
    stride_xh,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZED: tl.constexpr,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    # rows are (token, head) pairs, token-major: row = token * kvh + head
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    token = rows // NUM_KV_HEADS
    head = rows % NUM_KV_HEADS
    in_range = rows < num_rows
    slot = tl.load(slot_mapping_ptr + token, mask=in_range, other=-1).to(tl.int64)  # [BLOCK_R]
    r_mask = in_range & (slot >= 0)  # a negative slot is a padding token
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = r_mask[:, None] & (dims[None, :] < HEAD_DIM)  # [BLOCK_R, BLOCK_D]
    _store_rows(
        key_ptr, k_cache_ptr, k_scale_ptr, token, head, block_id, offset, dims, r_mask, mask,
        stride_kt, stride_kh, stride_cb, stride_co, stride_ch, stride_xb, stride_xo, stride_xh,
        QUANTIZED, QMAX, IS_FP8,
    )  # fmt: skip
    _store_rows(
        value_ptr, v_cache_ptr, v_scale_ptr, token, head, block_id, offset, dims, r_mask, mask,
        stride_vt, stride_vh, stride_cb, stride_co, stride_ch, stride_xb, stride_xo, stride_xh,
        QUANTIZED, QMAX, IS_FP8,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Launcher and public function (signature of kernels.reference.store_kv): one, since nothing is
# chosen before the launch
# ---------------------------------------------------------------------------------------------


def store_kv(
    key: torch.Tensor,  # [T, kvh, d]
    value: torch.Tensor,  # [T, kvh, d]
    k_cache: torch.Tensor,  # [nb, bs, kvh, d]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,  # [nb, bs, kvh]
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write T tokens' K/V into the paged cache at `slot_mapping`, quantizing if needed.

    Mutates `k_cache`, `v_cache` (and `k_scale`, `v_scale` for an int8/fp8 cache) in place.
    Checks the layouts (slot_mapping may also be int32), then launches one program per BLOCK_R
    (token, head) rows.
    """
    T, kvh, d = key.shape
    bs = k_cache.shape[1]
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert k_cache.shape[2:] == (kvh, d), f"k_cache {tuple(k_cache.shape)} vs key {key.shape}"
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert key.is_floating_point() and key.dtype not in QUANTIZED_DTYPES
    assert value.dtype == key.dtype
    assert slot_mapping.shape == (T,) and slot_mapping.dtype in (torch.int64, torch.int32)
    devices = {key.device, value.device, slot_mapping.device}
    quantized, ks, vs = check_cache(k_cache, v_cache, k_scale, v_scale, devices)
    if T == 0:
        return
    num_rows = T * kvh
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(4096 // block_d, triton.next_power_of_2(num_rows)))
    _store_kv_kernel[(triton.cdiv(num_rows, block_r),)](
        key, value, k_cache, v_cache, ks, vs, slot_mapping, num_rows,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        BLOCK_SIZE=bs, NUM_KV_HEADS=kvh, HEAD_DIM=d, BLOCK_R=block_r, BLOCK_D=block_d,
        QUANTIZED=quantized,
        QMAX=qmax_of(k_cache.dtype) if quantized else 0.0,
        IS_FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
    )  # fmt: skip
