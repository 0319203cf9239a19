"""Triton `prefill_attention`: causal FlashAttention over the paged cache, for chunked prefill.

Work split (FlashAttention-2): one program per (tile of BLOCK_M queries of one sequence, sequence,
query head). The program streams the sequence's keys from the paged cache in tiles of BLOCK_N
with the online softmax of `kernels.online_softmax`, so the [q_len, context] score matrix is
never materialized.

Invariants:
- Query i of sequence b (0 <= i < q_len, q_len = cu_query_lens[b+1] - cu_query_lens[b]) sits at
  position context_lens[b] - q_len + i and sees keys 0 ..= that position; the chunk's own K/V is
  already in the cache (store_kv ran first). So context_lens[b] >= q_len, and a sequence with
  q_len == 0 produces nothing.
- Keys are read in two phases: [0, lo) lies entirely before the tile's first query position
  (full tiles, no mask at all), [lo, hi) is the diagonal band (causal mask); hi is one past the
  tile's last position, so nothing at or beyond context_lens[b] is read.
- GQA/MQA: query head h reads KV head h // (num_heads // num_kv_heads). int8/fp8 caches are
  dequantized tile by tile like reference.gather_kv. Softmax statistics and the accumulator are
  float32; P is cast to the query dtype before P @ V; fp32 inputs use IEEE dot products.
- Query rows past q_len in the last tile are computed on zeros and never stored.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from kvserve.kernels.online_softmax import LOG2E, MASK_CAUSAL, MASK_NONE, attend_keys, dot_mode
from kvserve.kernels.reference import check_attention_operands

# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


# Long for a function: a Triton kernel takes every pointer, stride and constant as a parameter
# of its own (Triton has no structs).
@triton.jit
def _prefill_attention_kernel(
    out_ptr,  # [T, h, d]
    q_ptr,  # [T, h, d]
    k_cache_ptr,  # [nb, bs, kvh, d]
    v_cache_ptr,
    k_scale_ptr,  # [nb, bs, kvh] fp32 (read only when QUANTIZED)
    v_scale_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    cu_query_lens_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,  # k_cache and v_cache share strides
    stride_ct,
    stride_ch,
    stride_xb,  # k_scale and v_scale share strides
    stride_xt,
    stride_xh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_query_lens_ptr + b)
    q_len = tl.load(cu_query_lens_ptr + b + 1) - q_start
    if m_block * BLOCK_M < q_len:
        ctx = tl.load(context_lens_ptr + b)
        kv_head = head // GROUP
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index in the chunk
        dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        row_mask = rows < q_len
        d_mask = dims < HEAD_DIM
        io_mask = row_mask[:, None] & d_mask[None, :]  # [BLOCK_M, BLOCK_D]
        tok = (q_start + rows).to(tl.int64)  # [BLOCK_M] index in `query`
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head * stride_qh + dims[None, :],
            mask=io_mask,
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        q_pos = ctx - q_len + rows  # [BLOCK_M]
        first_pos = ctx - q_len + m_block * BLOCK_M
        lo = (first_pos // BLOCK_N) * BLOCK_N  # keys < lo precede every query of the tile
        hi = tl.minimum(first_pos + BLOCK_M, ctx)  # one past the tile's last position
        table_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc, m_i, l_i = attend_keys(
            acc, m_i, l_i, q, q_pos, 0, lo, table_ptr,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, dims, d_mask, qk_scale,
            stride_cb, stride_ct, stride_ch, stride_xb, stride_xt, stride_xh,
            BLOCK_SIZE, BLOCK_N, MASK_NONE, QUANTIZED, UPCAST_DOT, DOT_PRECISION,
        )  # fmt: skip
        acc, m_i, l_i = attend_keys(
            acc, m_i, l_i, q, q_pos, lo, hi, table_ptr,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, dims, d_mask, qk_scale,
            stride_cb, stride_ct, stride_ch, stride_xb, stride_xt, stride_xh,
            BLOCK_SIZE, BLOCK_N, MASK_CAUSAL, QUANTIZED, UPCAST_DOT, DOT_PRECISION,
        )  # fmt: skip
        out = acc / l_i[:, None]  # [BLOCK_M, BLOCK_D]
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _default_tiles(query: torch.Tensor, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the device and dtype."""
    if not query.is_cuda:
        return 32, 32, 4, 1  # the interpreter: few, small programs
    if query.dtype == torch.float32:
        return 64, 32, 4, 2  # fp32 tiles are twice the bytes
    if d <= 64:
        return 128, 64, 4, 3
    return 128, 64, 8, 3


def launch_prefill_attention(
    query: torch.Tensor,  # [T, h, d]
    k_cache: torch.Tensor,  # [nb, bs, kvh, d]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_query_lens: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    k_scale: torch.Tensor | None,  # [nb, bs, kvh] fp32 when quantized
    v_scale: torch.Tensor | None,
    block_m: int | None = None,
    block_n: int | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Check layouts and launch one program per (query tile, sequence, head).

    The grid is sized by the longest chunk: `max_query_len` when the caller knows it (the
    model runner does: no wait for the device; the caller vouches that cu_query_lens and
    context_lens agree with it), else read from cu_query_lens with one host sync, which also
    checks context_lens >= q_len. (Most of its length is the launch's argument list: a Triton
    kernel takes every stride and constant as a parameter of its own.)
    """
    T, h, d = query.shape
    bs, kvh = k_cache.shape[1:3]
    B = context_lens.shape[0]
    assert cu_query_lens.shape == (B + 1,) and cu_query_lens.dtype == torch.int32
    assert cu_query_lens.is_contiguous()
    quantized, ks, vs = check_attention_operands(
        query, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, cu_query_lens
    )

    out = torch.empty_like(query)  # [T, h, d]
    if B == 0 or T == 0:
        return out
    if max_query_len is None:
        q_lens = cu_query_lens[1:] - cu_query_lens[:-1]  # [B]
        checks = [q_lens.max(), (context_lens - q_lens).min(), cu_query_lens[-1]]
        max_q_len, min_slack, total = torch.stack(checks).tolist()
        assert min_slack >= 0, "context_lens[b] must count the chunk itself (>= its q_len)"
        assert total <= T, "cu_query_lens points past the end of query"
    else:
        max_q_len = max_query_len
        assert 0 <= max_q_len <= T, f"max_query_len {max_q_len} vs {T} query rows"
    if max_q_len == 0:
        return out

    dm, dn, num_warps, num_stages = _default_tiles(query, d)
    block_m, block_n = block_m or dm, block_n or dn
    for blk in (block_m, block_n):
        assert blk >= 16 and blk & (blk - 1) == 0, "tiles: powers of two >= 16"
    upcast, precision = dot_mode(query)
    grid = (triton.cdiv(max_q_len, block_m), B, h)
    _prefill_attention_kernel[grid](
        out, query, k_cache, v_cache, ks, vs, block_tables, cu_query_lens, context_lens,
        scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        block_tables.stride(0),
        GROUP=h // kvh, HEAD_DIM=d,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d), BLOCK_SIZE=bs,
        QUANTIZED=quantized, UPCAST_DOT=upcast,
        DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# Public function (signature of kernels.reference.prefill_attention)
# ---------------------------------------------------------------------------------------------


def prefill_attention(
    query: torch.Tensor,  # [T, h, d], the new tokens of all sequences, concatenated
    k_cache: torch.Tensor,  # [nb, bs, kvh, d], already holding the new tokens' K/V
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_query_lens: torch.Tensor,  # [B + 1] int32, offsets of each sequence's queries in `query`
    context_lens: torch.Tensor,  # [B] int32, tokens in the cache incl. this chunk
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,  # the longest chunk, when the caller knows it
) -> torch.Tensor:
    """Causal attention of each sequence's chunk over its cached prefix plus the chunk itself.

    Query i of sequence b (0 <= i < q_len) sits at position context_len - q_len + i and sees keys
    0 ..= that position. Returns [T, h, d] in the query's dtype; rows of `query` not covered by
    cu_query_lens are left uninitialized (as in the reference). With `max_query_len` the launch
    does not wait for the device (see `launch_prefill_attention`).
    """
    assert math.isfinite(scale)
    return launch_prefill_attention(
        query, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale,
        k_scale, v_scale, max_query_len=max_query_len,
    )  # fmt: skip
