"""Prefill attention for the CPU. Same signature and semantics as `reference.prefill_attention`.

float32 with head dims 32/64/80/96/128: a C++ flash-attention kernel (kernels/csrc, built once
per machine by cpp_build) that reads K/V in place from the paged cache. A work item is 32 query
positions of one sequence times the query heads of one KV head (K/V read once for the whole GQA
group); it walks the keys up to its last position 2 VW at a time (VW: the machine's vector
width, 16 or 8), in block-table order: the key tile transposed into [d][2 VW] so that a query
row's scores are two vectors of broadcast-multiply-adds (8 rows at a time with AVX-512, 6 with
AVX2), the online softmax with a vectorized exp, then P V with the accumulators in registers.
Tiles above the diagonal are never visited; the diagonal tile is masked per row. Keys come in
spans of 512 at fixed positions (0, 512, ...), each span a work item of its own with a partial
softmax (max, sum, unnormalized output per row), merged in span order afterwards: a short chunk
over a long cached prefix (a question after a system prompt) is then several work items per KV
head instead of one, where three KV heads on two threads left one idle a third of the time. A
row's arithmetic depends only on its own query, its position and the keys (the spans are fixed
by position): a token's result does not depend on how its prompt was chunked, what else is in
the batch or how many threads run. Work items go most keys first to whichever thread is free (a
static split would hand one thread the late, expensive tiles of a long prompt). Figures:
docs/benchmarks.md (CPU kernels).

Other dtypes (bf16 models), other head dims and a machine without a compiler take torch's flash
kernel, called so that it does no wasted work: a chunk of L new tokens after P cached ones is
attended in two parts whose softmaxes are merged by their log-sum-exps (as FlashInfer's cascade
merge does):
- the chunk over itself, causal: the kernel skips the key blocks above the diagonal (an explicit
  mask would make it compute them all) and reads each KV head for its group of query heads;
- the chunk over the P prefix tokens, unmasked, with each KV head's query heads stacked as rows
  of one [g * L, d] query, so K/V are read once per KV head instead of being expanded g times.
Quantized caches (int8, fp8 e4m3) take the C++ kernel too, which reads them in place: each key
tile's codes times their scales in fp32 as it is gathered (the reference's dequantized values
exactly), never a dequantized copy of the context; torch's kernel where the C++ one cannot run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from kvserve.kernels import cpp_build, reference

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

HEAD_DIMS = (32, 64, 80, 96, 128)  # the C++ kernel's instantiations


def _extension() -> Any | None:
    """The compiled kernels (cpp_build.extension), or None where they cannot be built."""
    return cpp_build.extension()


def available() -> bool:
    return _extension() is not None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, h, d] at positions P .. P+L-1 over k, v [P + L, kvh, d] -> [L, h, d]."""
    assert _FLASH is not None
    L, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    prefix = k.shape[0] - L
    kc, vc = k[prefix:], v[prefix:]  # fewer KV heads than query heads: the kernel maps them
    o, lse = _FLASH(
        q.transpose(0, 1)[None],
        kc.transpose(0, 1)[None],
        vc.transpose(0, 1)[None],
        0.0,
        True,
        scale=scale,
    )  # [1, h, L, d], [1, h, L]
    if prefix:
        qf = q.view(L, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * L, d)
        op, lp = _FLASH(
            qf, k[None, :prefix].transpose(1, 2), v[None, :prefix].transpose(1, 2), 0.0, False,
            scale=scale,
        )  # fmt: skip
        op, lp = op.reshape(1, h, L, d), lp.reshape(1, h, L)
        m = torch.maximum(lse, lp)
        wc, wp = (lse - m).exp(), (lp - m).exp()
        o = (o * wc[..., None] + op * wp[..., None]) / (wc + wp)[..., None]
    return o[0].transpose(0, 1)


def prefill_attention(
    query: torch.Tensor,  # [T, h, d], the new tokens of all sequences, concatenated
    k_cache: torch.Tensor,  # [nb, bs, kvh, d], already holding the new tokens' K/V
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_query_lens: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32, tokens in the cache incl. this chunk
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    args = (query, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale)
    if (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and query.shape[-1] in HEAD_DIMS
        and (ext := _extension()) is not None
    ):  # the C++ kernel
        assert query.shape[1] % k_cache.shape[2] == 0
        assert block_tables.dtype == cu_query_lens.dtype == context_lens.dtype == torch.int32
        scales = [] if k_scale is None or v_scale is None else [k_scale, v_scale]
        if scales or k_cache.dtype == v_cache.dtype == torch.float32:
            scales = [s.contiguous() for s in scales]
            tensors = (t.contiguous() for t in args[:-1])
            out: torch.Tensor = ext.prefill_attention(*tensors, float(scale), *scales)
            return out
    if _FLASH is None or query.device.type != "cpu":
        return reference.prefill_attention(*args, k_scale, v_scale)
    return _flash_prefill(args, k_scale, v_scale)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def _per_sequence(
    args: tuple[Any, ...],
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    attend: Attend,
) -> torch.Tensor:
    """`attend(q, k, v, ctx)` for each sequence: its queries over its context's blocks gathered
    (and dequantized) in order, [n * block_size, kvh, d] in the query's dtype. `args`:
    prefill_attention's (query, k_cache, v_cache, block_tables, cu_query_lens, context_lens,
    scale)."""
    query, k_cache, v_cache, block_tables, cu_query_lens, context_lens, _ = args
    bs = k_cache.shape[1]
    out = torch.empty_like(query)
    starts = cu_query_lens.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        table = block_tables[b, : -(-ctx // bs)]
        k = reference.gather_kv(k_cache, k_scale, table, query.dtype)
        v = reference.gather_kv(v_cache, v_scale, table, query.dtype)
        out[q0:q1] = attend(query[q0:q1], k, v, ctx)
    return out


def _flash_prefill(
    args: tuple[Any, ...], k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> torch.Tensor:
    """torch's flash kernel per sequence over its gathered (and dequantized) context."""
    scale = args[-1]
    return _per_sequence(
        args, k_scale, v_scale, lambda q, k, v, ctx: _attend(q, k[:ctx], v[:ctx], scale)
    )
