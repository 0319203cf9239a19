"""Triton store_kv against kernels.reference.

Tolerances: bit-exact (cache values and scales) whenever the input already has the cache's dtype
or the cache is int8/fp8. Casting fp32 input into a bf16 cache is exact on CUDA and within one
bf16 ulp (rtol 2**-7) under the interpreter, whose fp32 -> bf16 cast truncates.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
pytest.importorskip("triton")

from kvserve.kernels import reference as ref
from kvserve.kernels.store_kv import store_kv

from tests.kernels.kernel_cases import DEVICE, CacheTensors, empty_cache

CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]


def store_both(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    nb: int,
    bs: int,
    dtype: torch.dtype,
) -> tuple[CacheTensors, CacheTensors]:
    """key / value written at `slots` into zeroed caches of `nb` blocks of `bs` of `dtype`, by
    the Triton kernel and by the reference: (got, want), each (k, v, k_scale, v_scale)."""
    kvh, d = key.shape[1:]
    got = empty_cache(nb, bs, kvh, d, dtype)
    want = empty_cache(nb, bs, kvh, d, dtype)
    store_kv(key, value, *got[:2], slots, *got[2:])
    ref.store_kv(key, value, *want[:2], slots, *want[2:])
    return got, want


def assert_same(got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    """Same shape, dtype and bits (fp8 compared as bytes); or both None."""
    if got is None or want is None:
        assert got is None and want is None
        return
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (4, 128), (3, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_store_kv_matches_reference(
    cache_dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(0)
    nb, T = 5, 2 * block_size + 3  # a step that fills whole blocks plus a few slots
    in_dtype = torch.float32 if ref.is_quantized(cache_dtype) else cache_dtype
    key = torch.randn(T, num_kv_heads, head_dim, device=DEVICE).to(in_dtype)  # [T, kvh, d]
    value = torch.randn(T, num_kv_heads, head_dim, device=DEVICE).to(in_dtype)
    slots = torch.randperm(nb * block_size, device=DEVICE)[:T]  # [T] int64, distinct
    for g, w in zip(*store_both(key, value, slots, nb, block_size, cache_dtype), strict=True):
        assert_same(g, w)


def test_store_kv_casts_fp32_input_into_bf16_cache() -> None:
    torch.manual_seed(1)
    key = torch.randn(9, 2, 64, device=DEVICE)  # [T, kvh, d] fp32
    value = torch.randn(9, 2, 64, device=DEVICE)
    slots = torch.tensor([0, 1, 2, 17, 18, 40, 41, 42, 63], device=DEVICE)
    got, want = store_both(key, value, slots, 4, 16, torch.bfloat16)
    rtol = 0.0 if DEVICE == "cuda" else 2**-7
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=rtol, atol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.int8])
def test_store_kv_reads_strided_views_of_a_fused_projection(cache_dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    T, h, kvh, d = 6, 4, 2, 64
    qkv = torch.randn(T, (h + 2 * kvh) * d, device=DEVICE).to(torch.float16)
    key = qkv[:, h * d : (h + kvh) * d].view(T, kvh, d)  # row stride (h + 2 kvh) d
    value = qkv[:, (h + kvh) * d :].view(T, kvh, d)
    assert not key.is_contiguous()
    slots = torch.tensor([5, 6, 7, 8, 30, 31], device=DEVICE)
    for g, w in zip(*store_both(key, value, slots, 2, 16, cache_dtype), strict=True):
        assert_same(g, w)


def test_store_kv_writes_only_the_mapped_slots_and_skips_negative_ones() -> None:
    torch.manual_seed(3)
    k_cache, v_cache, k_scale, v_scale = empty_cache(3, 16, 2, 64, torch.int8)
    k_scale.fill_(-1.0)  # type: ignore[union-attr]
    v_scale.fill_(-1.0)  # type: ignore[union-attr]
    key = torch.randn(3, 2, 64, device=DEVICE) + 1.0  # no all-zero row
    value = torch.randn(3, 2, 64, device=DEVICE) + 1.0
    slots = torch.tensor([20, -1, 47], device=DEVICE)  # token 1 is padding
    store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    written = torch.zeros(48, dtype=torch.bool, device=DEVICE)
    written[[20, 47]] = True
    assert k_scale is not None
    assert bool((k_scale.view(48, 2)[written] > 0).all())
    assert bool((k_scale.view(48, 2)[~written] == -1.0).all())
    assert bool((k_cache.view(48, 2, 64)[~written] == 0).all())
    q, s = ref.quantize_kv(key[2], torch.int8)
    assert torch.equal(k_cache[2, 15], q) and torch.equal(k_scale[2, 15], s)


def test_store_kv_with_no_tokens_is_a_no_op() -> None:
    k_cache, v_cache, _, _ = empty_cache(2, 16, 2, 64, torch.float32)
    empty = torch.empty(0, 2, 64, device=DEVICE)
    store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert not k_cache.any() and not v_cache.any()


def test_store_kv_rejects_a_quantized_cache_without_scales() -> None:
    k_cache, v_cache, _, _ = empty_cache(2, 16, 2, 64, torch.int8)
    x = torch.randn(1, 2, 64, device=DEVICE)
    with pytest.raises(AssertionError):
        store_kv(x, x, k_cache, v_cache, torch.zeros(1, dtype=torch.int64, device=DEVICE))
