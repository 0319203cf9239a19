"""The online softmax over paged K/V that both Triton attention kernels run (FlashAttention's
inner loop): `attend_keys` folds a range of a sequence's cached keys, BLOCK_N at a time in
block-table order, into query rows' running max, running sum and unnormalized accumulator.
`paged_decode` calls it once per split-K partition (MASK_TAIL), `prefill_attention` twice per
query tile: the keys before the tile's first position (MASK_NONE), then the diagonal band
(MASK_CAUSAL).

These are device functions that kernels call, not kernels with a reference of their own.

Invariants:
- A key tile is read as reference.gather_kv reads it: int8/e4m3 values times their (token,
  head) scale, rounded once to the query dtype; masked keys read as 0 and never touch memory.
- Scores, softmax statistics and the accumulator are float32 in the log2 domain (exp2; the
  caller's qk_scale includes log2 e); P is cast to the query dtype before P @ V; fp32 operands
  use IEEE (not TF32) dot products (`dot_mode`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax is computed with exp2: e^x = 2^(x * log2 e)
# Which keys of a tile attend_keys masks
MASK_NONE: tl.constexpr = tl.constexpr(0)  # none: whole tiles before every query's position
MASK_TAIL: tl.constexpr = tl.constexpr(1)  # those at or past the end of the range
MASK_CAUSAL: tl.constexpr = tl.constexpr(2)  # those too, and those after the row's position


def dot_mode(query: torch.Tensor) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION) for a kernel on `query`'s device and dtype: upcast under the
    interpreter (see `_dot`); "ieee" for fp32 operands (and upcast ones), else "tf32"."""
    upcast = not query.is_cuda
    return upcast, "ieee" if upcast or query.dtype == torch.float32 else "tf32"


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a [M, K] @ b [K, N] -> fp32 [M, N]. UPCAST: multiply in fp32 (the interpreter's tl.dot
    reads bf16 operands as raw integers); PRECISION: "ieee" for fp32 operands, not TF32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _load_kv_tile(
    cache_ptr, scale_ptr, kv_off, x_off, dims, t_mask, d_mask, dtype, QUANTIZED: tl.constexpr
):
    """A [BLOCK_N, BLOCK_D] tile of K or V in `dtype` (the query's), like reference.gather_kv:
    int8/e4m3 values times their (token, head) scale, rounded once to `dtype`. Masked tokens read
    as 0 and never touch memory. kv_off [BLOCK_N]: element offsets of the tokens' rows for this KV
    head in the cache; x_off [BLOCK_N]: the same in the scale tensor."""
    x = tl.load(
        cache_ptr + kv_off[:, None] + dims[None, :],
        mask=t_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_N, BLOCK_D]
    if QUANTIZED:
        scale = tl.load(scale_ptr + x_off, mask=t_mask, other=0.0)  # [BLOCK_N]
        # via fp32: exact for int8/e4m3, and the interpreter cannot cast int8 to bf16 directly
        x = x.to(tl.float32) * scale[:, None]
    return x.to(dtype)


# Long for a function: a Triton kernel takes every pointer, stride and constant as a parameter
# of its own (Triton has no structs).
@triton.jit
def attend_keys(
    acc,  # [BLOCK_M, BLOCK_D] fp32 running sum of 2^(s - m_i) v
    m_i,  # [BLOCK_M] fp32 running max (log2 domain)
    l_i,  # [BLOCK_M] fp32 running sum of 2^(s - m_i)
    q,  # [BLOCK_M, BLOCK_D] query dtype
    q_pos,  # [BLOCK_M] int32 positions of the tile's queries
    lo,
    hi,  # keys [lo, hi) of this phase
    table_ptr,  # this sequence's row of block_tables
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    kv_head,
    dims,
    d_mask,
    qk_scale,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_xb,
    stride_xt,
    stride_xh,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,  # MASK_NONE, MASK_TAIL or MASK_CAUSAL
    QUANTIZED: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The online-softmax update of the query rows q over the keys [lo, hi) of one KV head,
    BLOCK_N at a time in block-table order; returns the new (acc, m_i, l_i). MASK_NONE: every
    tile is whole (hi - lo a multiple of BLOCK_N); MASK_TAIL: keys at or past hi are masked;
    MASK_CAUSAL: also keys past each row's position q_pos."""
    for start in range(lo, hi, BLOCK_N):
        toks = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        t_mask = toks < hi
        block_ids = tl.load(table_ptr + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        kv_off = block_ids * stride_cb + (toks % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        x_off = block_ids * stride_xb + (toks % BLOCK_SIZE) * stride_xt + kv_head * stride_xh
        k = _load_kv_tile(
            k_cache_ptr, k_scale_ptr, kv_off, x_off, dims, t_mask, d_mask, q.dtype, QUANTIZED
        )  # [BLOCK_N, BLOCK_D]
        s = _dot(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASK == MASK_CAUSAL:
            allowed = (toks[None, :] <= q_pos[:, None]) & t_mask[None, :]  # [BLOCK_M, BLOCK_N]
            s = tl.where(allowed, s, float("-inf"))
        elif MASK == MASK_TAIL:
            s = tl.where(t_mask[None, :], s, float("-inf"))
        # finite: every tile has a live key for every row (key `lo` of the causal phase is at
        # or before every row's position)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_M]
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(
            v_cache_ptr, v_scale_ptr, kv_off, x_off, dims, t_mask, d_mask, q.dtype, QUANTIZED
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, UPCAST_DOT, DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
