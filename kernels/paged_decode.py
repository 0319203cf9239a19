"""Triton `paged_decode_attention`: one query token per sequence over its paged KV cache.

Work split (PagedAttention v2 / FlashDecoding):
- One program per (sequence b, KV head, partition): the `group = num_heads // num_kv_heads` query
  heads that share the KV head form the rows of one Q tile (padded to >= 16 rows for `tl.dot`),
  so each K/V tile is read once per KV head (GQA/MQA: query head h reads KV head h // group).
- A partition is `partition_size` consecutive context positions (512; on CUDA halved, down to
  128, while the grid would leave SMs idle), walked in tiles of `block_n` tokens with the online
  softmax of `kernels.online_softmax` (running max m, running sum l, unnormalized accumulator).
- One partition in total: the program writes the normalized output itself. Several (split-K):
  each live partition writes (m, l, acc / l) in float32, and a reduce kernel combines them:
  out = sum_p l_p 2^(m_p - M) o_p / sum_p l_p 2^(m_p - M), M = max_p m_p.

Invariants:
- Only positions < context_lens[b] are read: K/V past a sequence's length (stale or
  uninitialized memory, any block id in the table's tail) never reach the arithmetic.
- context_lens[b] >= 1 (as in the reference), so partition 0 of every sequence is live and the
  reduce always has a finite max.
- The number of partitions is bounded by `block_tables.shape[1] * block_size` (no host sync, so the
  launch is CUDA-graph safe); partitions past a sequence's length exit at once.
- int8/fp8 caches are dequantized on the fly, tile by tile, exactly as reference.gather_kv does
  (raw value times its (token, head) scale, rounded once to the query dtype).
- Scores, softmax and accumulators are float32; P is cast to the query dtype before P @ V, as the
  reference casts its probabilities. fp32 inputs use IEEE (not TF32) dot products.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from kvserve.kernels.online_softmax import LOG2E, MASK_TAIL, attend_keys, dot_mode
from kvserve.kernels.reference import check_attention_operands

DEFAULT_PARTITION_SIZE = 512  # context positions per split-K partition
MIN_PARTITION_SIZE = 128  # what a small batch may shrink partitions to, to fill the GPU
MIN_DOT_ROWS = 16  # tl.dot needs M >= 16


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


# Long for a function: a Triton kernel takes every pointer, stride and constant as a parameter
# of its own (Triton has no structs).
@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [B, h, d], written when not SPLIT
    part_out_ptr,  # [B, h, P, d] fp32, written when SPLIT
    part_max_ptr,  # [B, h, P] fp32 (log2 domain)
    part_sum_ptr,  # [B, h, P] fp32
    q_ptr,  # [B, h, d]
    k_cache_ptr,  # [nb, bs, kvh, d]
    v_cache_ptr,  # [nb, bs, kvh, d]
    k_scale_ptr,  # [nb, bs, kvh] fp32 (read only when QUANTIZED)
    v_scale_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,  # k_cache and v_cache share strides
    stride_ct,
    stride_ch,
    stride_xb,  # k_scale and v_scale share strides
    stride_xt,
    stride_xh,
    stride_bt,
    num_partitions,  # P: a runtime value, so a growing block table does not recompile
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    start = part * PARTITION_SIZE
    if start < ctx:
        end = tl.minimum(start + PARTITION_SIZE, ctx)
        rows = tl.arange(0, BLOCK_G)  # [BLOCK_G] query heads of this KV head
        dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        heads = kv_head * GROUP + rows
        row_mask = rows < GROUP
        d_mask = dims < HEAD_DIM
        q = tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_G, BLOCK_D]
        table_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (log2 domain)
        l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of 2^(s - m_i)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # running sum of 2^(s - m_i) v
        acc, m_i, l_i = attend_keys(
            acc, m_i, l_i, q, rows, start, end, table_ptr,  # rows: no positions (not causal)
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, dims, d_mask, qk_scale,
            stride_cb, stride_ct, stride_ch, stride_xb, stride_xt, stride_xh,
            BLOCK_SIZE, BLOCK_N, MASK_TAIL, QUANTIZED, UPCAST_DOT, DOT_PRECISION,
        )  # fmt: skip
        out = acc / l_i[:, None]  # [BLOCK_G, BLOCK_D]
        out_mask = row_mask[:, None] & d_mask[None, :]
        if SPLIT:
            # part_* are contiguous: [B, h, P(, d)]
            ml_off = (b.to(tl.int64) * NUM_HEADS + heads) * num_partitions + part
            tl.store(part_max_ptr + ml_off, m_i, mask=row_mask)
            tl.store(part_sum_ptr + ml_off, l_i, mask=row_mask)
            tl.store(part_out_ptr + ml_off[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
        else:
            o_ptrs = (
                out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
            )
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,  # [B, h, d]
    part_out_ptr,  # [B, h, P, d] fp32
    part_max_ptr,  # [B, h, P] fp32
    part_sum_ptr,  # [B, h, P] fp32
    context_lens_ptr,  # [B] int32
    stride_ob,
    stride_oh,
    num_partitions,  # P
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + b)
    live = tl.cdiv(ctx, PARTITION_SIZE)  # partitions that hold at least one position
    row = b.to(tl.int64) * tl.num_programs(1) + head  # index of (b, head) in [B, h]
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    big_m = tl.load(part_max_ptr + row * num_partitions)  # partition 0 is always live
    for p in range(1, live):
        big_m = tl.maximum(big_m, tl.load(part_max_ptr + row * num_partitions + p))
    acc = tl.zeros([BLOCK_D], tl.float32)
    denom = tl.zeros([], tl.float32)
    for p in range(0, live):
        idx = row * num_partitions + p
        w = tl.load(part_sum_ptr + idx) * tl.exp2(tl.load(part_max_ptr + idx) - big_m)
        o = tl.load(part_out_ptr + idx * HEAD_DIM + dims, mask=d_mask, other=0.0)  # [BLOCK_D]
        acc += w * o
        denom += w
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + dims
    tl.store(o_ptrs, (acc / denom).to(out_ptr.dtype.element_ty), mask=d_mask)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def launch_paged_decode(
    query: torch.Tensor,  # [B, h, d]
    k_cache: torch.Tensor,  # [nb, bs, kvh, d]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    k_scale: torch.Tensor | None,  # [nb, bs, kvh] fp32 when quantized
    v_scale: torch.Tensor | None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    block_n: int | None = None,
) -> torch.Tensor:
    """Check layouts, run the partition kernel and, when split, the reduce kernel. (Most of its
    length is the launches' argument lists: a Triton kernel takes every stride and constant as
    a parameter of its own.)"""
    B, h, d = query.shape
    bs, kvh = k_cache.shape[1:3]
    assert context_lens.shape == (B,), f"context_lens {tuple(context_lens.shape)} vs {B} queries"
    quantized, ks, vs = check_attention_operands(
        query, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale
    )

    group = h // kvh
    if block_n is None:
        block_n = min(64 if query.dtype != torch.float32 else 32, partition_size)
    assert block_n >= 16 and block_n & (block_n - 1) == 0, "block_n: a power of two >= 16"
    assert partition_size % block_n == 0, "a partition is a whole number of tiles"
    max_len = block_tables.shape[1] * bs  # upper bound on any context length (no host sync)
    num_partitions = max(1, triton.cdiv(max_len, partition_size))
    split = num_partitions > 1

    out = torch.empty_like(query)  # [B, h, d]
    if B == 0:
        return out
    part_out, part_max, part_sum = _partition_buffers(out, num_partitions)
    block_d = triton.next_power_of_2(d)
    upcast, precision = dot_mode(query)
    _paged_decode_kernel[(B, kvh, num_partitions)](
        out, part_out, part_max, part_sum,
        query, k_cache, v_cache, ks, vs, block_tables, context_lens,
        scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        block_tables.stride(0), num_partitions,
        NUM_HEADS=h, GROUP=group, HEAD_DIM=d,
        BLOCK_G=max(MIN_DOT_ROWS, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_SIZE=bs, BLOCK_N=block_n,
        PARTITION_SIZE=partition_size,
        QUANTIZED=quantized, SPLIT=split,
        UPCAST_DOT=upcast, DOT_PRECISION=precision,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if split:
        _paged_decode_reduce_kernel[(B, h)](
            out, part_out, part_max, part_sum, context_lens,
            out.stride(0), out.stride(1), num_partitions,
            HEAD_DIM=d, BLOCK_D=block_d, PARTITION_SIZE=partition_size,
            num_warps=1 if block_d <= 128 else 4,
        )  # fmt: skip
    return out


def _partition_buffers(
    out: torch.Tensor, num_partitions: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split-K partials (out [B, h, P, d], max and sum [B, h, P], fp32), or `out` three
    times when there is one partition (the kernel then never touches them)."""
    if num_partitions == 1:
        return out, out, out
    B, h, d = out.shape
    part_out = torch.empty(B, h, num_partitions, d, dtype=torch.float32, device=out.device)
    part_max = torch.empty(B, h, num_partitions, dtype=torch.float32, device=out.device)
    return part_out, part_max, torch.empty_like(part_max)


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def partition_size_for(query: torch.Tensor, num_kv_heads: int, max_len: int) -> int:
    """512 positions per partition, halved (down to 128) while the grid would give the GPU fewer
    than two programs per SM: a batch of one still reads a 1k context with the whole GPU."""
    size = DEFAULT_PARTITION_SIZE
    if not query.is_cuda:
        return size
    index = query.device.index
    target = 2 * _num_sms(torch.cuda.current_device() if index is None else index)
    programs = query.shape[0] * num_kv_heads
    while size > MIN_PARTITION_SIZE and programs * triton.cdiv(max_len, size) < target:
        size //= 2
    return size


# ---------------------------------------------------------------------------------------------
# Public function (signature of kernels.reference.paged_decode_attention)
# ---------------------------------------------------------------------------------------------


def paged_decode_attention(
    query: torch.Tensor,  # [B, h, d]
    k_cache: torch.Tensor,  # [nb, bs, kvh, d]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its first context_lens[b] cached tokens.

    Returns [B, h, d] in the query's dtype. Reads the cache, writes nothing but the output.
    """
    assert math.isfinite(scale)
    max_len = block_tables.shape[1] * k_cache.shape[1]
    partition_size = partition_size_for(query, k_cache.shape[2], max_len)
    return launch_paged_decode(
        query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
        partition_size=partition_size,
    )  # fmt: skip
