"""Triton paged_decode_attention against kernels.reference.

Tolerances (|got - want| <= atol + rtol * |want|, outputs are O(1)):
- fp32 query and cache: atol 1e-4, rtol 1e-4
- fp16: atol 2e-3, rtol 2e-3
- bf16: atol 2e-2, rtol 2e-2
- int8 / fp8 cache with a bf16 query: atol 3e-2, rtol 2e-2 (the reference rounds the dequantized
  values to bf16 once, the kernel once more for P; the interpreter truncates instead of rounding)
- int8 cache with an fp32 query: atol 1e-4, rtol 1e-4 (dequantization is exact arithmetic).
The reference computes scores in the query dtype; the kernel keeps them in fp32, so low-precision
differences are the reference's rounding as much as the kernel's.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
pytest.importorskip("triton")

from kvserve.kernels import reference as ref
from kvserve.kernels.paged_decode import launch_paged_decode, paged_decode_attention

from tests.kernels.kernel_cases import (
    DEVICE,
    AttentionCase,
    PagedKV,
    attention_cases,
    make_paged_kv,
)


def context_lens_for(block_size: int) -> list[int]:
    """Ragged: a single token, exactly one and three blocks, and two odd lengths."""
    return [1, block_size, 3 * block_size, 37, 130]


def run_both(
    kv: PagedKV, query: torch.Tensor, partition_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = query.shape[-1] ** -0.5
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale)
    want = ref.paged_decode_attention(*args, kv.k_scale, kv.v_scale)
    if partition_size is None:
        got = paged_decode_attention(*args, kv.k_scale, kv.v_scale)
    else:
        got = launch_paged_decode(*args, kv.k_scale, kv.v_scale, partition_size=partition_size)
    return got, want


@pytest.mark.parametrize("partition_size", [None, 32], ids=["one-partition", "split-k-32"])
@pytest.mark.parametrize("case", attention_cases())
def test_paged_decode_matches_reference(case: AttentionCase, partition_size: int | None) -> None:
    lens = context_lens_for(case.block_size)
    kv = case.paged_kv(lens)
    shape = (len(lens), case.num_heads, case.head_dim)
    query = torch.randn(shape, device=DEVICE).to(case.q_dtype)  # [B, h, d]
    got, want = run_both(kv, query, partition_size)
    assert got.shape == shape and got.dtype == case.q_dtype
    case.assert_close(got, want)


@pytest.mark.parametrize("partition_size", [None, 32], ids=["one-partition", "split-k-32"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
def test_paged_decode_never_reads_past_a_sequence(
    cache_dtype: torch.dtype, partition_size: int | None
) -> None:
    """NaN in every slot beyond the context lengths (block tails, spare blocks in the tables'
    tails) must not reach the output. The reference is run before poisoning: its masked
    softmax still multiplies the poisoned V by 0."""
    kv = make_paged_kv([5, 16, 33], 2, 64, 16, cache_dtype)
    query = torch.randn(3, 4, 64, device=DEVICE)
    _, want = run_both(kv, query, None)
    kv.poison_unused()
    got, _ = run_both(kv, query, partition_size)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_split_k_agrees_with_one_partition_on_a_long_context() -> None:
    kv = make_paged_kv([700, 64, 1], 2, 64, 16, torch.float32)
    query = torch.randn(3, 8, 64, device=DEVICE)
    two, want = run_both(kv, query, None)  # the default 512-token partitions: 2
    many, _ = run_both(kv, query, 64)  # 11 live partitions for the long sequence
    torch.testing.assert_close(two, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(many, want, atol=1e-4, rtol=1e-4)


def test_paged_decode_rejects_bad_layouts() -> None:
    kv = make_paged_kv([3], 2, 64, 16, torch.float32)
    query = torch.randn(1, 3, 64, device=DEVICE)  # 3 heads over 2 KV heads
    with pytest.raises(AssertionError):
        paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 1.0)
    query = torch.randn(1, 4, 64, device=DEVICE)
    with pytest.raises(AssertionError):  # block tables must be int32
        paged_decode_attention(
            query, kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.context_lens, 1.0
        )
