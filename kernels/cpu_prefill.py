"""Prefill attention for the CPU: torch's flash-attention kernel, called so that it does no
wasted work. Same signature and semantics as `reference.prefill_attention`.

A chunk of L new tokens after P cached ones is attended in two parts whose softmaxes are merged
by their log-sum-exps (as FlashInfer's cascade merge does):
- the chunk over itself, causal: the kernel skips the key blocks above the diagonal (an explicit
  mask would make it compute them all) and reads each KV head for its group of query heads (no
  copy expanding K/V to the query heads: 5-17% faster at 128-512 tokens, the same result);
- the chunk over the P prefix tokens, unmasked, with each KV head's query heads stacked as rows
  of one [g * L, d] query, so K/V are read once per KV head instead of being expanded g times.
"""

from __future__ import annotations

import torch
from kvserve.kernels import reference

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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
    if _FLASH is None or query.device.type != "cpu":
        return reference.prefill_attention(
            query, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale,
            k_scale, v_scale,
        )  # fmt: skip
    bs = k_cache.shape[1]
    out = torch.empty_like(query)
    starts = cu_query_lens.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        table = block_tables[b, : -(-ctx // bs)]
        k = reference.gather_kv(k_cache, k_scale, table, query.dtype)[:ctx]
        v = reference.gather_kv(v_cache, v_scale, table, query.dtype)[:ctx]
        out[q0:q1] = _attend(query[q0:q1], k, v, scale)
    return out
