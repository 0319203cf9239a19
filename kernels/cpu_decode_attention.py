"""Paged decode attention for the CPU: a C++ kernel (kernels/csrc, built once per machine by
cpp_build) that reads K/V in place from the paged cache. Same signature and semantics as
`reference.paged_decode_attention`, for float32 caches and int8 / fp8 (e4m3) ones (with their
per-token, per-head scales) and head dims of 32, 64, 80, 96 or 128; anything else (a machine
where the build fails) uses the reference. A quantized row's dot products are scaled by its K
scale and its softmax weights by the V scales: the reference's products with the dequantized
values, factored, so the values are widened to fp32 in registers (exactly, e4m3 too) and
never written out.

Each query row takes a block VW tokens at a time (the machine's vector width, csrc/simd.h:
16 with AVX-512, 8 with AVX2) with everything in registers: VW dot products reduced together
into one vector of scores (a transpose-reduce, not VW horizontal sums), a vectorized exp for
the online softmax, then the VW V rows accumulated; a full chunk of VW tokens runs with its loops
unrolled, and every product is an explicit FMA, which -ffast-math cannot reassociate differently
in the unrolled and the general version. While it works on one block it prefetches
the sequence's next block (whose address the hardware prefetcher cannot guess: blocks are
scattered), a slice per query row. Figures: docs/benchmarks.md (CPU kernels).

Shared prefixes are read once (cascade attention, as FlashInfer and vLLM do it on GPUs):
sequences whose block tables start with the same physical blocks (prefix-cache hits, n > 1
samples, beams) form a group of up to 8, and the leading blocks full in every member are streamed
once for all the group's query rows; each member then walks its own remaining blocks. One work
item per group, parallel with at::parallel_for; with fewer groups than threads (one sequence
at batch 1) a group's heads are split into runs, one item each, so that every thread works
(a batch-1 decode step 5.5-5.7 -> 5.2 ms on an AMX Xeon, docs/benchmarks.md). Each query row
keeps its own block-wise online softmax and sees its blocks in table order, so its result is
bit-identical to running the sequence alone, on any number of threads.
"""

from __future__ import annotations

from typing import Any

import torch
from kvserve.kernels import cpp_build, cpu_ops, reference

HEAD_DIMS = (32, 64, 80, 96, 128)  # the kernel's instantiations; others use the reference


def _extension() -> Any | None:
    """The compiled kernels (cpp_build.extension), or None where they cannot be built."""
    return cpp_build.extension()


def available() -> bool:
    return _extension() is not None


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
    ext = _extension()
    if ext is None or not supported(query, k_cache, v_cache, k_scale):
        return reference.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale
        )
    assert query.shape[1] % k_cache.shape[2] == 0
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    scales = (None, None) if k_scale is None or v_scale is None else (k_scale, v_scale)
    out: torch.Tensor = ext.paged_decode(
        query.contiguous(),
        k_cache.contiguous(),
        v_cache.contiguous(),
        block_tables.contiguous(),
        context_lens.contiguous(),
        float(scale),
        *(s if s is None else s.contiguous() for s in scales),
    )
    return out


def supported(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None
) -> bool:
    """Whether the kernel takes these operands: fp32 queries on the CPU with a head dim of
    HEAD_DIMS, over a cache the C++ kernels take (`cpu_ops.takes_cache`)."""
    return (
        query.dtype == torch.float32
        and query.shape[-1] in HEAD_DIMS
        and query.is_cpu
        and cpu_ops.takes_cache(k_cache, v_cache, k_scale)
    )
