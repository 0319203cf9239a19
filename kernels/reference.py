"""Torch references for every kernel: the spec the Triton kernels are tested against, and the
implementation the engine runs on the CPU.

Layouts (shared by every kernel):
- paged cache, per layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads,
  head_dim]; dtype float32 / bfloat16 / float16, or int8 / float8_e4m3fn when quantized.
- scales of a quantized cache: `k_scale`, `v_scale` float32 [num_blocks, block_size, num_kv_heads]
  (one per token and head); None for an unquantized cache.
- `slot_mapping[i] = block_id * block_size + offset`: where token i's K/V lives.
- `block_tables` int32 [num_seqs, max_blocks]: a sequence's block ids in order; entries past the
  sequence's length are ignored (any valid id).
- GQA/MQA: query head h reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_DTYPES


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(token, head) quantization over the last (head_dim) axis.

    x: [..., head_dim] float -> (q: [..., head_dim] of `dtype`, scale: [...] float32)
    with x ~= q * scale[..., None].
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    if dtype == torch.int8:
        scale = (amax / INT8_MAX).clamp_min(1e-8)
        q = torch.round(xf / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif dtype == torch.float8_e4m3fn:
        scale = (amax / FP8_E4M3_MAX).clamp_min(1e-8)
        q = (xf / scale[..., None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"quantize_kv: unsupported dtype {dtype}")
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q: [..., head_dim] int8/fp8, scale: [...] -> [..., head_dim] of `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def store_kv(
    key: torch.Tensor,  # [T, kvh, d]
    value: torch.Tensor,  # [T, kvh, d]
    k_cache: torch.Tensor,  # [nb, bs, kvh, d]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,  # [nb, bs, kvh]
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write T tokens' K/V into the paged cache at `slot_mapping`, quantizing if needed."""
    nb, bs, kvh, d = k_cache.shape
    k_flat = k_cache.view(nb * bs, kvh, d)
    v_flat = v_cache.view(nb * bs, kvh, d)
    if is_quantized(k_cache.dtype):
        assert k_scale is not None and v_scale is not None
        kq, ks = quantize_kv(key, k_cache.dtype)
        vq, vs = quantize_kv(value, v_cache.dtype)
        k_flat.index_copy_(0, slot_mapping, kq)
        v_flat.index_copy_(0, slot_mapping, vq)
        k_scale.view(nb * bs, kvh).index_copy_(0, slot_mapping, ks)
        v_scale.view(nb * bs, kvh).index_copy_(0, slot_mapping, vs)
    else:
        k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor,  # [nb, bs, kvh, d]
    scale: torch.Tensor | None,  # [nb, bs, kvh]
    block_table: torch.Tensor,  # [..., n] block ids
    dtype: torch.dtype,
) -> torch.Tensor:
    """The blocks of `block_table`, contiguous: [..., n * bs, kvh, d] in `dtype`."""
    blocks = cache[block_table.long()]  # [..., n, bs, kvh, d]
    if scale is not None:
        blocks = dequantize_kv(blocks, scale[block_table.long()], dtype)
    else:
        blocks = blocks.to(dtype)
    return blocks.flatten(-4, -3)


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
    """One query token per sequence attending to its first context_lens[b] cached tokens."""
    B, h, d = query.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = h // kvh
    max_len = int(context_lens.max())
    n = (max_len + bs - 1) // bs
    tables = block_tables[:, :n]
    k = gather_kv(k_cache, k_scale, tables, query.dtype)  # [B, n*bs, kvh, d]
    v = gather_kv(v_cache, v_scale, tables, query.dtype)
    q = query.view(B, kvh, group, d)
    scores = torch.einsum("bkgd,btkd->bkgt", q, k) * scale  # [B, kvh, g, n*bs]
    pos = torch.arange(n * bs, device=query.device)
    masked = pos[None, :] >= context_lens[:, None].to(pos.dtype)  # [B, n*bs]
    scores.masked_fill_(masked[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = torch.einsum("bkgt,btkd->bkgd", probs, v)  # [B, kvh, g, d]
    return out.reshape(B, h, d)


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
) -> torch.Tensor:
    """Causal attention of each sequence's chunk over its cached prefix plus the chunk itself.

    Query i of sequence b (0 <= i < q_len) sits at position context_len - q_len + i and sees keys
    0 ..= that position.
    """
    _T, h, _d = query.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    starts = cu_query_lens.tolist()
    lens = context_lens.tolist()
    for b, ctx in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        n = (ctx + bs - 1) // bs
        k = gather_kv(k_cache, k_scale, block_tables[b, :n], query.dtype)[:ctx]  # [ctx, kvh, d]
        v = gather_kv(v_cache, v_scale, block_tables[b, :n], query.dtype)[:ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        allowed = torch.arange(ctx, device=query.device)[None, :] <= q_pos[:, None]  # [q, ctx]
        o = torch.nn.functional.scaled_dot_product_attention(
            query[q0:q1].transpose(0, 1),  # [h, q, d]
            k.transpose(0, 1),  # [kvh, ctx, d]
            v.transpose(0, 1),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=kvh != h,
        )
        out[q0:q1] = o.transpose(0, 1)
    return out
