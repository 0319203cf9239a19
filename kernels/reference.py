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


def check_cache(
    k_cache: torch.Tensor,  # [nb, bs, kvh, d]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    devices: set[torch.device],
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """Launcher checks shared by the Triton kernels: K and V caches of one shape, stride and
    dtype, head_dim contiguous; a quantized cache needs fp32 scales of shape [nb, bs, kvh] with
    equal strides; an unquantized one is fp32/bf16/fp16. Returns (quantized, k_scale, v_scale)
    with the cache standing in for scales that are never read, and asserts every tensor (the
    caches, the scales and those in `devices`) is on one device."""
    nb, bs, kvh, _ = k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert v_cache.dtype == k_cache.dtype, "K and V caches must share a dtype"
    assert k_cache.stride(3) == 1, "cache head_dim must be contiguous"
    devices = devices | {k_cache.device, v_cache.device}
    quantized = is_quantized(k_cache.dtype)
    if quantized:
        assert k_scale is not None and v_scale is not None, "a quantized cache needs scales"
        assert k_scale.shape == (nb, bs, kvh) and v_scale.shape == (nb, bs, kvh)
        assert k_scale.dtype == v_scale.dtype == torch.float32
        assert k_scale.stride() == v_scale.stride()
        devices = devices | {k_scale.device, v_scale.device}
        ks, vs = k_scale, v_scale
    else:
        assert k_cache.dtype in (torch.float32, torch.bfloat16, torch.float16)
        ks = vs = k_cache  # never read: QUANTIZED is False
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    return quantized, ks, vs


def check_attention_operands(
    query: torch.Tensor,  # [T or B, h, d]
    k_cache: torch.Tensor,  # [nb, bs, kvh, d]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *more: torch.Tensor,  # further operands that must be on the same device
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """Launcher checks shared by the Triton attention kernels: shapes, dtypes and the strides
    the kernels assume, then `check_cache` (whose result this returns)."""
    _, h, d = query.shape
    kvh = k_cache.shape[2]
    B = context_lens.shape[0]
    assert k_cache.dim() == 4 and k_cache.shape[3] == d, (
        f"k_cache {tuple(k_cache.shape)} vs query {query.shape}"
    )
    assert h % kvh == 0, f"num_heads {h} is not a multiple of num_kv_heads {kvh}"
    assert query.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert query.stride(2) == 1, "head_dim must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == B
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert context_lens.shape == (B,) and context_lens.dtype == torch.int32
    assert context_lens.is_contiguous()
    tensors = (query, block_tables, context_lens, *more)
    return check_cache(k_cache, v_cache, k_scale, v_scale, {t.device for t in tensors})


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(token, head) quantization over the last (head_dim) axis.

    x: [..., head_dim] float -> (q: [..., head_dim] of `dtype`, scale: [...] float32)
    with x ~= q * scale[..., None].
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # The divisor is a tensor: CUDA torch divides by a Python number as a multiplication by its
    # reciprocal, one ulp off IEEE division (the Triton kernels' and the CPU's) for some values.
    if dtype == torch.int8:
        scale = (amax / amax.new_tensor(INT8_MAX)).clamp_min(1e-8)
        q = torch.round(xf / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif dtype == torch.float8_e4m3fn:
        scale = (amax / amax.new_tensor(FP8_E4M3_MAX)).clamp_min(1e-8)
        q = (xf / scale[..., None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"quantize_kv: unsupported dtype {dtype}")
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q: [..., head_dim] int8/fp8, scale: [...] -> [..., head_dim] of `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def _slot_view(cache: torch.Tensor) -> torch.Tensor:
    """[nb, bs, ...] -> [nb * bs, ...]; fp8 as uint8 (CPU torch has no fp8 index_copy_)."""
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    return flat.view(torch.uint8) if flat.dtype == torch.float8_e4m3fn else flat


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
    if is_quantized(k_cache.dtype):
        assert k_scale is not None and v_scale is not None
        kq, ks = quantize_kv(key, k_cache.dtype)
        vq, vs = quantize_kv(value, v_cache.dtype)
        if kq.dtype == torch.float8_e4m3fn:
            kq, vq = kq.view(torch.uint8), vq.view(torch.uint8)
        _slot_view(k_cache).index_copy_(0, slot_mapping, kq)
        _slot_view(v_cache).index_copy_(0, slot_mapping, vq)
        _slot_view(k_scale).index_copy_(0, slot_mapping, ks)
        _slot_view(v_scale).index_copy_(0, slot_mapping, vs)
    else:
        _slot_view(k_cache).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        _slot_view(v_cache).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor,  # [nb, bs, kvh, d]
    scale: torch.Tensor | None,  # [nb, bs, kvh]
    block_table: torch.Tensor,  # [..., n] block ids
    dtype: torch.dtype,
) -> torch.Tensor:
    """The blocks of `block_table`, contiguous: [..., n * bs, kvh, d] in `dtype`."""
    nb, bs, kvh, d = cache.shape
    ids = block_table.reshape(-1).long()
    raw = cache.view(nb, bs * kvh * d).index_select(0, ids)  # one memcpy per block
    blocks = raw.view(*block_table.shape, bs, kvh, d)
    if scale is not None:
        s = scale.view(nb, bs * kvh).index_select(0, ids).view(*block_table.shape, bs, kvh)
        blocks = dequantize_kv(blocks, s, dtype)
    else:
        blocks = blocks.to(dtype)
    return blocks.flatten(-4, -3)


def _length_groups(lens: list[int], max_waste: float = 0.25) -> list[list[int]]:
    """Indices of sequences grouped by similar length (longest first), so padding each group
    to its longest member wastes at most about `max_waste` of the work."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None:
            padded = lens[g[0]] * (len(g) + 1)
            if padded <= (1 + max_waste) * (sum(lens[j] for j in g) + lens[i]):
                g.append(i)
                continue
        groups.append([i])
    return groups


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

    Sequences of similar length are batched into one masked SDPA call each (padding to the
    group's longest). Cache slots past a sequence's length must hold finite values (the engine's
    cache is zero-initialised and only ever holds computed K/V).
    """
    h = query.shape[1]
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    lens = context_lens.tolist()
    out = torch.empty_like(query)
    for group in _length_groups(lens):
        idx = torch.tensor(group, device=query.device)
        n = (lens[group[0]] + bs - 1) // bs
        tables = block_tables[idx, :n]
        k = gather_kv(k_cache, k_scale, tables, query.dtype)  # [G, n*bs, kvh, d]
        v = gather_kv(v_cache, v_scale, tables, query.dtype)
        pos = torch.arange(n * bs, device=query.device)
        allowed = pos[None, :] < context_lens[idx, None]  # [G, n*bs]
        o = torch.nn.functional.scaled_dot_product_attention(
            query[idx, :, None, :],  # [G, h, 1, d]
            k.transpose(1, 2),  # [G, kvh, n*bs, d]
            v.transpose(1, 2),
            attn_mask=allowed[:, None, None, :],
            scale=scale,
            enable_gqa=kvh != h,
        )
        out[idx] = o[:, :, 0, :]
    return out


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
        if kvh != h:  # GQA/MQA: query head i reads KV head i // (h // kvh)
            k = k.repeat_interleave(h // kvh, dim=1)
            v = v.repeat_interleave(h // kvh, dim=1)
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        allowed = torch.arange(ctx, device=query.device)[None, :] <= q_pos[:, None]  # [q, ctx]
        # 4-D inputs with as many K/V heads as query heads: torch's CPU dispatch then takes its
        # flash kernel rather than the slower math path that 3-D or enable_gqa inputs get.
        o = torch.nn.functional.scaled_dot_product_attention(
            query[None, q0:q1].transpose(1, 2),  # [1, h, q, d]
            k[None].transpose(1, 2),  # [1, h, ctx, d]
            v[None].transpose(1, 2),
            attn_mask=allowed[None, None],
            scale=scale,
        )
        out[q0:q1] = o[0].transpose(0, 1)
    return out
